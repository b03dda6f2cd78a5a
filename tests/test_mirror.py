"""The object-storage mirror against a real S3 server (SeaweedFS on loopback, scripts/objstore.sh).

Outcomes are read back from the bucket and the local roots: objects, markers, bytes, steps.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from helpers.core import model_equal, tiny_state
from helpers.objstore import aws_env, s3, unique_url  # noqa: F401 - s3 is a fixture

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MARKER, step_dir_name
from slurmresume.checkpoint.store import find_latest
from slurmresume.mirror import parse_s3_url
from slurmresume.mirror.transfer import download_step, put_marker, read_committed, upload_step
from slurmresume.storage import bucketsteps
from slurmresume.storage.s3 import client


@pytest.fixture
def url(s3) -> str:
    return unique_url()


def save(root: Path, *steps: int, **kwargs) -> None:
    ckpt = Checkpointer(root, handle_signals=False, **kwargs)
    for s in steps:
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0 / (s + 1)})
    ckpt.close()


def keys(s3, url: str) -> list[str]:
    loc = parse_s3_url(url)
    res = s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.prefix + "/")
    return sorted(o["Key"][len(loc.prefix) + 1:] for o in res.get("Contents") or [])


def test_upload_then_download_round_trip(s3, url: str, tmp_path: Path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    save(src, 5)
    loc = parse_s3_url(url)
    result = upload_step(s3, loc, src / step_dir_name(5), 5)
    assert result.action == "uploaded"
    attempt = s3.head_object(Bucket=loc.bucket, Key=loc.key(5, MARKER))["Metadata"]["slurmresume-objects"]
    assert keys(s3, url) == [f"{step_dir_name(5)}/{n}" for n in ("COMMITTED", f"{attempt}/manifest.json",
                                                                  f"{attempt}/rank-00000-of-00001.safetensors",
                                                                  f"{attempt}/rank-00000.index.json")]
    assert upload_step(s3, loc, src / step_dir_name(5), 5).action == "present"  # idempotent
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 5 and info.verified
    assert download_step(s3, loc, 5, dst).action == "downloaded"
    for name in ("COMMITTED", "manifest.json", "rank-00000-of-00001.safetensors"):
        assert (dst / step_dir_name(5) / name).read_bytes() == (src / step_dir_name(5) / name).read_bytes()
    assert [p.name for p in dst.iterdir() if p.name.startswith(".mirror")] == []


def test_multipart_upload_and_ranged_download_of_a_larger_step(s3, url: str, tmp_path: Path) -> None:
    import torch

    src, dst = tmp_path / "src", tmp_path / "dst"
    ckpt = Checkpointer(src, handle_signals=False)
    ckpt.save(1, {"w": torch.arange(3 << 20, dtype=torch.float32)})  # 12 MiB: 3 parts of 5 MiB
    ckpt.close()
    loc = parse_s3_url(url)
    assert upload_step(s3, loc, src / step_dir_name(1), 1, chunk=5 << 20).action == "uploaded"
    assert download_step(s3, loc, 1, dst, chunk=1 << 20).action == "downloaded"
    shard = "rank-00000-of-00001.safetensors"
    assert (dst / step_dir_name(1) / shard).read_bytes() == (src / step_dir_name(1) / shard).read_bytes()
    out = {"w": torch.zeros(3 << 20)}
    assert Checkpointer(dst, handle_signals=False).restore(out) == 1
    assert torch.equal(out["w"], torch.arange(3 << 20, dtype=torch.float32))


@pytest.mark.slow
def test_concurrent_marker_writers_exactly_one_wins(s3, url: str, tmp_path: Path) -> None:
    """N writers race If-None-Match PUTs of one step's marker, each with its own client and
    token: exactly one is told it won, and the stored marker carries the winner's token."""
    save(tmp_path, 3)
    marker_raw = read_committed(tmp_path / step_dir_name(3), 3)[0]
    loc = parse_s3_url(url)
    n, rounds = 8, 5
    clients = [client() for _ in range(n)]
    for r in range(rounds):
        step = 3 + 1000 * r
        start = threading.Barrier(n)
        wins: list[str] = []

        def writer(i: int, step: int = step, start: threading.Barrier = start, wins: list[str] = wins) -> None:
            start.wait()
            if put_marker(clients[i], loc, step, marker_raw, token=f"writer-{i}"):
                wins.append(f"writer-{i}")

        threads = [threading.Thread(target=writer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(wins) == 1, f"round {r}: winners {wins}"
        stored = s3.head_object(Bucket=loc.bucket, Key=loc.key(step, MARKER))
        assert stored["Metadata"]["slurmresume-writer"] == wins[0]


def test_checkpointer_uploads_every_commit_and_restores_from_the_mirror(s3, url: str, tmp_path: Path) -> None:
    local = tmp_path / "local"
    ckpt = Checkpointer(local, handle_signals=False, mirror=url)
    for s in (2, 4):
        ckpt.save(s, tiny_state(s))
    ckpt.close()  # waits for the uploader
    loc = parse_s3_url(url)
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 4 and info.verified
    # the local root is lost: a new run restores step 4 from the bucket, verified, bitwise
    import shutil

    shutil.rmtree(local)
    state = tiny_state(0)
    ckpt = Checkpointer(local, handle_signals=False, mirror=url)
    assert ckpt.restore(state) == 4
    ckpt.close()
    assert model_equal(state["model"], tiny_state(4)["model"]) and state["extra"] == tiny_state(4)["extra"]
    latest = find_latest(local, warn=False)
    assert latest is not None and latest.step == 4


def test_restore_prefers_a_newer_mirror_step_over_the_local_root(s3, url: str, tmp_path: Path) -> None:
    a, b = tmp_path / "cluster-a", tmp_path / "cluster-b"
    save(b, 1)  # cluster B ran an old step locally
    save(a, 1, 6, mirror=url)  # cluster A went further and mirrored it
    state = tiny_state(0)
    ckpt = Checkpointer(b, handle_signals=False, mirror=url)
    assert ckpt.restore(state) == 6
    ckpt.close()
    assert model_equal(state["model"], tiny_state(6)["model"])


def test_a_corrupt_mirror_step_is_never_loaded(s3, url: str, tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    save(a, 2, 7, mirror=url)
    loc = parse_s3_url(url)
    key = bucketsteps.object_key(s3, loc, 7, "rank-00000-of-00001.safetensors")
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF  # same size, one flipped byte
    s3.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    state = tiny_state(0)
    ckpt = Checkpointer(b, handle_signals=False, mirror=url)
    assert ckpt.restore(state) == 2  # step 7 fails its checksum on download: falls back to 2
    ckpt.close()
    assert not (b / step_dir_name(7)).exists()
    assert model_equal(state["model"], tiny_state(2)["model"])


def test_an_unreachable_mirror_with_an_empty_root_refuses_to_start_fresh(tmp_path: Path, monkeypatch) -> None:
    from slurmresume.errors import CheckpointError

    for key, value in aws_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    ckpt = Checkpointer(tmp_path / "r", handle_signals=False, mirror="s3://slurmresume-test/x")
    with pytest.raises(CheckpointError, match="cannot be read"):
        ckpt.restore(tiny_state(0))
    ckpt.close()


def test_bad_mirror_urls_are_one_line_config_errors(tmp_path: Path) -> None:
    from slurmresume.errors import ConfigError

    for bad in ("http://x/y", "s3://", "s3://UPPER/x", "s3://ok-bucket/../x", "s3://ok-bucket/a//b"):
        with pytest.raises(ConfigError, match="mirror"):
            Checkpointer(tmp_path, handle_signals=False, mirror=bad)
    assert os.environ.get("SLURMRESUME_MIRROR") is None


def test_retention_applies_on_both_tiers(s3, url: str, tmp_path: Path) -> None:
    from slurmresume import RetentionPolicy
    ckpt = Checkpointer(tmp_path, handle_signals=False, mirror=url, retention=RetentionPolicy(keep=2))
    for s in (1, 2, 3, 4):
        ckpt.save(s, tiny_state(s))
        ckpt.mirror.wait()
    ckpt.close()
    loc = parse_s3_url(url)
    assert [(i.step, i.complete) for i in bucketsteps.list_remote(s3, loc)] == [(4, True), (3, True)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step_")) == \
        [step_dir_name(3), step_dir_name(4)]


def test_restore_of_a_step_only_the_mirror_holds(s3, url: str, tmp_path: Path) -> None:
    import shutil

    local = tmp_path / "local"
    for s in (2, 4, 6):  # one session each: close() waits for its upload (within one session the
        save(local, s, mirror=url)  # uploader may skip 4 for 6 while 2 is still uploading)
    shutil.rmtree(local / step_dir_name(4))  # e.g. pruned locally, kept on the bucket
    state = tiny_state(0)
    ckpt = Checkpointer(local, handle_signals=False, mirror=url)
    assert ckpt.restore(state, step=4) == 4  # downloaded, verified, then loaded
    ckpt.close()
    assert model_equal(state["model"], tiny_state(4)["model"]) and state["extra"] == tiny_state(4)["extra"]
    assert find_latest(local, warn=False).step == 6  # the newer local step is untouched
    other = tmp_path / "other-cluster"  # no local root at all
    state = tiny_state(0)
    ckpt = Checkpointer(other, handle_signals=False, mirror=url)
    assert ckpt.restore(state, step=2) == 2
    ckpt.close()
    assert model_equal(state["model"], tiny_state(2)["model"])
    assert [p.name for p in other.iterdir() if p.name.startswith("step_")] == [step_dir_name(2)]


def test_restore_of_a_step_on_neither_tier_or_corrupt_on_the_mirror_refuses(s3, url: str, tmp_path: Path) -> None:
    from slurmresume.errors import CheckpointError

    save(tmp_path / "a", 3, 5, mirror=url)
    b = tmp_path / "b"
    ckpt = Checkpointer(b, handle_signals=False, mirror=url)
    with pytest.raises(CheckpointError, match=r"step 4 is not a complete checkpoint .* nor on the mirror"):
        ckpt.restore(tiny_state(0), step=4)
    loc = parse_s3_url(url)
    key = bucketsteps.object_key(s3, loc, 3, "rank-00000-of-00001.safetensors")
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    with pytest.raises(CheckpointError, match="fails its checksum after download"):
        ckpt.restore(tiny_state(0), step=3)  # never falls back to another step when one was asked for
    ckpt.close()
    assert not [p for p in b.iterdir() if p.name.startswith(("step_", ".mirror"))]

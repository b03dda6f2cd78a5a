"""Two runs uploading the same step to one bucket at once, against the real S3 server.

Only the marker can be written conditionally, so a commit is safe only when the objects the
winning marker names cannot be touched by the loser: each upload attempt writes its shards
and manifest under its own keys, and the marker names them.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MANIFEST, MARKER, step_dir_name
from slurmresume.mirror import parse_s3_url
from slurmresume.mirror.transfer import Transfer, download_step, upload_step
from slurmresume.storage import bucketsteps
from slurmresume.storage.s3 import client

SHARD = "rank-00000-of-00001.safetensors"
ROUNDS = 20


def saved(root: Path, seed: int) -> None:
    ckpt = Checkpointer(root, handle_signals=False)
    for step in range(1, ROUNDS + 1):
        g = torch.Generator().manual_seed(seed * 1000 + step)
        ckpt.save(step, {"w": torch.randn(256 << 10, generator=g), "who": seed})  # 1 MiB: one PUT
    ckpt.close()


def test_two_full_uploads_of_one_step_racing_leave_the_winner_loadable(s3, tmp_path: Path) -> None:
    roots = [tmp_path / "run-a", tmp_path / "run-b"]
    for seed, root in enumerate(roots):
        saved(root, seed)
    loc = parse_s3_url(unique_url())
    clients = [client(), client()]
    for step in range(1, ROUNDS + 1):
        start = threading.Barrier(2)
        results: dict[int, Transfer] = {}

        def run(i: int, step: int = step, start: threading.Barrier = start,
                results: dict[int, Transfer] = results) -> None:
            start.wait()
            results[i] = upload_step(clients[i], loc, roots[i] / step_dir_name(step), step)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert sorted(r.action for r in results.values()) == ["conflict", "uploaded"], (step, results)
        winner = roots[next(i for i, r in results.items() if r.action == "uploaded")] / step_dir_name(step)
        info = bucketsteps.find_latest(s3, loc, verify=True)
        assert info is not None and info.step == step and info.verified, (step, info)
        dst = tmp_path / f"restored-{step}"
        assert download_step(s3, loc, step, dst).action == "downloaded"
        for name in (SHARD, MANIFEST):
            assert (dst / step_dir_name(step) / name).read_bytes() == (winner / name).read_bytes(), (step, name)
        # the loser removed its own objects: only the marker and the folder it names are left
        folder = s3.head_object(Bucket=loc.bucket, Key=loc.key(step, MARKER))["Metadata"]["slurmresume-objects"]
        left = sorted(o["Key"][len(loc.step_prefix(step)):] for o in
                      s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.step_prefix(step)).get("Contents") or [])
        assert left == [MARKER, f"{folder}/{MANIFEST}", f"{folder}/{SHARD}", f"{folder}/rank-00000.index.json"], (step, left)
        assert not s3.list_multipart_uploads(Bucket=loc.bucket, Prefix=loc.step_prefix(step)).get("Uploads")


def test_a_bucket_in_the_layout_before_attempt_folders_still_reads(s3, tmp_path: Path) -> None:
    """Files beside the marker, no folder named in it: what earlier versions wrote."""
    root = tmp_path / "root"
    ckpt = Checkpointer(root, handle_signals=False)
    ckpt.save(4, {"w": torch.arange(1000.0)})
    ckpt.close()
    loc = parse_s3_url(unique_url())
    step_dir = root / step_dir_name(4)  # every file (shard, its index, manifest), the marker last
    for name in [p.name for p in sorted(step_dir.iterdir()) if p.name != MARKER] + [MARKER]:
        s3.put_object(Bucket=loc.bucket, Key=loc.key(4, name), Body=(step_dir / name).read_bytes())
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 4 and info.verified
    assert download_step(s3, loc, 4, tmp_path / "dst").action == "downloaded"
    assert (tmp_path / "dst" / step_dir_name(4) / SHARD).read_bytes() == (root / step_dir_name(4) / SHARD).read_bytes()
    assert upload_step(s3, loc, root / step_dir_name(4), 4).action == "present"  # same commit: left as it is
    assert bucketsteps.find_latest(s3, loc, verify=True).verified

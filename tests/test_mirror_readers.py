"""`inspect` and `export` on `s3://` roots against the real S3 server: the same output as on
the local root the steps came from, verified bytes only, one error line for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.core import tiny_state
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture
from safetensors import safe_open
from safetensors.torch import load_file
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.cli import app
from slurmresume.mirror import parse_s3_url
from slurmresume.storage import bucketsteps

SHARD = "rank-00000-of-00001.safetensors"


def run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


@pytest.fixture
def mirrored(s3, tmp_path: Path) -> tuple[Path, str]:
    """(local root, bucket URL) holding the same committed steps 1 and 2."""
    url, local = unique_url(), tmp_path / "local"
    ckpt = Checkpointer(local, handle_signals=False, mirror=url)
    for s in (1, 2):
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0 / (s + 1)})
        ckpt.mirror.wait()
    ckpt.close()
    return local, url


@pytest.mark.slow
@pytest.mark.parametrize("tensors", [False, True])
def test_inspect_on_a_bucket_matches_the_local_root(mirrored, tensors: bool) -> None:
    local, url = mirrored
    flags = ["--tensors"] if tensors else []
    for which in ("latest", "1"):
        here = run("inspect", which, "--json", "--ckpt-dir", local, *flags)
        there = run("inspect", which, "--json", "--ckpt-dir", url, *flags)
        assert here.exit_code == 0 and there.exit_code == 0, there.output
        a, b = json.loads(here.stdout), json.loads(there.stdout)
        step = 2 if which == "latest" else 1
        assert b["path"] == f"{url}/{step_dir_name(step)}" and a["path"] == str(local / step_dir_name(step))
        assert {**a, "path": ""} == {**b, "path": ""}
        assert b["stats_computed"] is tensors and b["tensors"]
    text_here = run("inspect", "latest", "--ckpt-dir", local, *flags)
    text_there = run("inspect", f"{url}/{step_dir_name(2)}", *flags)  # a step URL, as `latest` prints it
    assert text_there.exit_code == 0, text_there.output
    assert text_here.stdout.replace(str(local / step_dir_name(2)), "P") == \
        text_there.stdout.replace(f"{url}/{step_dir_name(2)}", "P")


def test_export_on_a_bucket_writes_the_same_weights(mirrored, tmp_path: Path) -> None:
    local, url = mirrored
    out_local, out_s3 = tmp_path / "a.safetensors", tmp_path / "out" / "b.safetensors"
    out_s3.parent.mkdir()
    assert run("export", "1", "--ckpt-dir", local, "--out", out_local).exit_code == 0
    res = run("export", "1", "--ckpt-dir", url, "--out", out_s3)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip().endswith("bytes from step 1")
    a, b = load_file(str(out_local)), load_file(str(out_s3))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    with safe_open(str(out_s3), "pt") as f:
        assert f.metadata()["slurmresume.source"] == f"{url}/{step_dir_name(1)}"
    assert sorted(p.name for p in out_s3.parent.iterdir()) == ["b.safetensors"]  # the download is gone
    step2 = run("export", f"{url}/{step_dir_name(2)}", "--out", out_s3)  # a step URL, as `latest` prints it
    assert step2.exit_code == 0, step2.output
    assert run("export", "2", "--ckpt-dir", local, "--out", out_local).exit_code == 0
    a, b = load_file(str(out_local)), load_file(str(out_s3))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_export_refuses_a_bucket_step_that_fails_its_checksum(s3, mirrored, tmp_path: Path) -> None:
    _, url = mirrored
    loc = parse_s3_url(url)
    key = bucketsteps.object_key(s3, loc, 2, SHARD)
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF  # same size: only the hash can tell
    s3.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    out = tmp_path / "o" / "m.safetensors"
    out.parent.mkdir()
    res = run("export", "latest", "--ckpt-dir", url, "--out", out)
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.startswith("error: ") and "fails its checksum after download" in res.stderr
    assert list(out.parent.iterdir()) == []  # no output, no leftover download


@pytest.mark.slow
@pytest.mark.parametrize("args, message", [
    (["inspect", "latest", "--ckpt-dir", "s3://no-such-bucket-xyz/run"], "NoSuchBucket"),
    (["export", "latest", "--ckpt-dir", "s3://no-such-bucket-xyz/run"], "NoSuchBucket"),
    (["inspect", "latest", "--ckpt-dir", "EMPTY"], "no complete checkpoint under s3://"),
    (["export", "latest", "--ckpt-dir", "EMPTY"], "no complete checkpoint under s3://"),
    (["inspect", "7", "--ckpt-dir", "URL"], "no step 7 under s3://"),
    (["export", "3", "--ckpt-dir", "URL"], "is incomplete (no commit marker"),
    (["inspect", "s3://Bad_Bucket/x", "--ckpt-dir", "URL"], "is not a valid S3 bucket name"),
    (["export", "latest", "--ckpt-dir", "s3://ok-bucket/../x"], "is not allowed"),
])
def test_bad_input_on_a_bucket_is_one_error_line(s3, mirrored, tmp_path: Path, args: list[str],
                                                 message: str) -> None:
    _, url = mirrored
    loc = parse_s3_url(url)
    s3.put_object(Bucket=loc.bucket, Key=loc.key(3, SHARD), Body=b"x" * 10)  # step 3: no marker yet
    args = [{"URL": url, "EMPTY": unique_url()}.get(a, a) for a in args]
    res = run(*args, "--out", tmp_path / "m.safetensors") if args[0] == "export" else run(*args)
    assert res.exit_code == 1, res.output
    assert res.stdout == "" and "Traceback" not in res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], res.stderr
    assert not (tmp_path / "m.safetensors").exists()


def test_a_bucket_as_the_checkpoint_root_is_refused_with_the_mirror_spelling(tmp_path: Path, monkeypatch) -> None:
    """No bucket-only root (every rank writes its shard into the root, rank 0 commits there):
    `submit --ckpt-dir s3://...` and `Checkpointer("s3://...")` say to use a directory + mirror,
    and write nothing (pathlib would otherwise make a local folder named "s3:")."""
    from slurmresume.errors import ConfigError

    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('hi')\n")
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # no sbatch is ever reached
    res = run("submit", script, "--ckpt-dir", "s3://bkt/run1", "--dry-run")
    assert res.exit_code == 1 and res.stdout == ""
    assert res.stderr.strip() == ("error: checkpoint root s3://bkt/run1 is a bucket: the root must be a directory "
                                  "every rank can write (saves land there first, fast); give one and put the bucket "
                                  "in --mirror, e.g. --ckpt-dir /scratch/run1 --mirror s3://bkt/run1")
    with pytest.raises(ConfigError, match=r"Checkpointer\('/scratch/run1', mirror='s3://bkt/run1'\)"):
        Checkpointer("s3://bkt/run1", handle_signals=False)
    monkeypatch.setenv("SLURMRESUME_CKPT_DIR", "s3://bkt/run1")
    with pytest.raises(ConfigError, match="is a bucket"):
        Checkpointer(handle_signals=False)
    assert list(tmp_path.iterdir()) == [script]

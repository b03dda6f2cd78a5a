"""`latest`, `verify` and `prune` with `--ckpt-dir s3://...` against the real S3 server."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.core import tiny_state
from helpers.objstore import aws_env, s3, unique_url  # noqa: F401 - s3 is a fixture
from helpers.procs import REPO, clean_env
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MARKER, step_dir_name
from slurmresume.cli import app
from slurmresume.mirror import parse_s3_url
from slurmresume.storage import bucketsteps

SHARD = "rank-00000-of-00001.safetensors"


def run(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], env={"COLUMNS": "200"})


def mirrored(tmp_path: Path, *steps: int) -> str:
    url = unique_url()
    ckpt = Checkpointer(tmp_path / "local", handle_signals=False, mirror=url)
    for s in steps:
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0 / (s + 1)})
        ckpt.mirror.wait()  # every step on the bucket, not only the newest waiting one
    ckpt.close()
    return url


def half_uploaded(s3, url: str, step: int) -> None:
    """A step whose shard is there and whose marker is not (an upload in progress or killed)."""
    loc = parse_s3_url(url)
    s3.put_object(Bucket=loc.bucket, Key=loc.key(step, SHARD), Body=b"x" * 100)


def test_latest_on_a_bucket_skips_an_incomplete_newer_step(s3, tmp_path: Path) -> None:
    url = mirrored(tmp_path, 1, 2)
    half_uploaded(s3, url, 3)
    out = run("latest", "--ckpt-dir", url)
    assert out.exit_code == 0, out.output
    assert out.stdout.strip() == f"{url}/{step_dir_name(2)}"
    empty = run("latest", "--ckpt-dir", unique_url())
    assert empty.exit_code == 1 and empty.stdout == ""
    assert empty.stderr.strip().startswith("error: no complete checkpoint under s3://")
    doc = json.loads(run("latest", "--json", "-d", url).stdout)  # --json: the same answer, one object
    assert doc == {"schema": "slurmresume.latest/1", "root": url, "step": 2, "path": f"{url}/{step_dir_name(2)}",
                   "skipped": []}


def test_verify_on_a_bucket_names_the_bad_shard(s3, tmp_path: Path) -> None:
    url = mirrored(tmp_path, 1, 2)
    ok = run("verify", "--all", "--ckpt-dir", url)
    assert ok.exit_code == 0, ok.output
    assert ok.stdout.count("ok ") == 2
    loc = parse_s3_url(url)
    key = bucketsteps.object_key(s3, loc, 1, SHARD)
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 1
    s3.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    bad = run("verify", "--all", "--ckpt-dir", url)
    assert bad.exit_code == 1
    assert f"s3://{loc.bucket}/{key} fails its checksum" in bad.stderr
    assert run("verify", "--ckpt-dir", url).exit_code == 0  # the newest (2) is fine
    as_json = run("verify", "--all", "--json", "-d", url)
    assert as_json.exit_code == 1 and f"s3://{loc.bucket}/{key} fails its checksum" in as_json.stderr
    doc = json.loads(as_json.stdout)
    assert doc["ok"] is False and [(c["step"], c["ok"]) for c in doc["checkpoints"]] == [(2, True), (1, False)]


def test_prune_on_a_bucket_keeps_the_newest_and_the_step_being_uploaded(s3, tmp_path: Path) -> None:
    url = mirrored(tmp_path, 1, 2, 3)
    half_uploaded(s3, url, 4)  # newer than every complete step, no marker: being uploaded
    out = run("prune", "--keep", "1", "--yes", "--ckpt-dir", url)
    assert out.exit_code == 0, out.output
    loc = parse_s3_url(url)
    assert [(i.step, i.complete) for i in bucketsteps.list_remote(s3, loc)] == [(4, False), (3, True)]
    assert not (s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.step_prefix(1)).get("Contents"))


@pytest.mark.slow
def test_prune_killed_mid_deletion_leaves_no_complete_half_step(s3, tmp_path: Path) -> None:
    url = mirrored(tmp_path, 1, 2)
    env = clean_env(**aws_env(), SLURMRESUME_TEST_KILL_AT="mirror.delete.objects")
    proc = subprocess.run([sys.executable, "-m", "slurmresume", "prune", "--keep", "1", "--yes", "--ckpt-dir", url],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    loc = parse_s3_url(url)
    left = {o["Key"].rsplit("/", 1)[-1] for o in
            s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.step_prefix(1)).get("Contents") or []}
    assert MARKER not in left and SHARD in left  # marker went first: step 1 is incomplete, not corrupt-complete
    assert [(i.step, i.complete) for i in bucketsteps.list_remote(s3, loc)] == [(2, True), (1, False)]
    assert run("latest", "--ckpt-dir", url).stdout.strip() == f"{url}/{step_dir_name(2)}"


def test_a_bad_s3_root_is_one_error_line(s3) -> None:
    out = run("latest", "--ckpt-dir", "s3://Bad_Bucket/x")
    assert out.exit_code == 1 and out.stderr.count("\n") == 1 and "bucket" in out.stderr


def test_status_on_a_bucket_lists_complete_and_uploading_steps(s3, tmp_path: Path) -> None:
    import json

    url = mirrored(tmp_path, 1, 2)
    loc = parse_s3_url(url)
    s3.create_multipart_upload(Bucket=loc.bucket, Key=loc.key(3, SHARD))  # an upload in flight
    out = run("status", "--json", "--verify", "--ckpt-dir", url)
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["newest_complete"] == 2
    assert [(c["step"], c["complete"], c["uploading"], c["verified"]) for c in data["checkpoints"]] == \
        [(3, False, True, None), (2, True, False, True), (1, True, False, True)]
    text = run("status", "--ckpt-dir", url)
    assert text.exit_code == 0 and "being uploaded" in text.stdout and "newest complete: 2" in text.stdout


def test_verify_and_latest_take_the_bucket_url_as_their_argument(s3, tmp_path: Path) -> None:
    url = mirrored(tmp_path, 1, 2)
    loc = parse_s3_url(url)
    out = run("latest", url)
    assert out.exit_code == 0, out.output
    assert out.stdout.strip() == loc.step_url(2)
    out = run("verify", url)
    assert out.exit_code == 0, out.output
    assert loc.step_url(2) in out.stdout and loc.step_url(1) not in out.stdout
    out = run("verify", loc.step_url(1))  # a step URL, as `latest` prints it
    assert out.exit_code == 0, out.output
    assert loc.step_url(1) in out.stdout and loc.step_url(2) not in out.stdout
    out = run("verify", "--all", url)
    assert out.exit_code == 0 and loc.step_url(1) in out.stdout and loc.step_url(2) in out.stdout, out.output
    key = bucketsteps.object_key(s3, loc, 2, SHARD)
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    s3.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))
    out = run("verify", url)
    assert out.exit_code == 1 and "fails its checksum" in out.output
    for args in (["verify", url, "--ckpt-dir", url], ["latest", url, "--ckpt-dir", str(tmp_path)],
                 ["verify", "twelve"]):
        out = run(*args)
        assert out.exit_code == 1 and out.output.count("error:") == 1 and "Traceback" not in out.output, out.output

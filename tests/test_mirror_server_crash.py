"""The S3 server SIGKILLed in the middle of a run's multipart upload and started again, on a
SeaweedFS of the test's own (helpers/objstore.PrivateStore: the shared one stays up for the
other tests). The run goes on and finishes: none of its own uploads stays on the bucket, and
`status` says none is in flight; another writer's live upload is left alone (the age rule)."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path

import pytest
import torch
from helpers.objstore import ensure_bucket, private_store, unique_url  # noqa: F401 - private_store is a fixture
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.cli import app
from slurmresume.mirror import parse_s3_url, upload
from slurmresume.storage import bucketsteps
from slurmresume.storage.s3 import client

SHARD = "rank-00000-of-00001.safetensors"
PART = 5 << 20  # S3's smallest part: the 12 MiB shard below is a three-part upload
HANG_GUARD = 600.0  # seconds; only ever reached when something hangs


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3 << 20, generator=g), "step": step}


def uploads(s3, loc, step: int | None = None) -> set[tuple[str, str]]:
    prefix = loc.step_prefix(step) if step is not None else f"{loc.prefix}/"
    return {(u["Key"], u["UploadId"]) for u in s3.list_multipart_uploads(Bucket=loc.bucket, Prefix=prefix)
            .get("Uploads") or []}


@pytest.mark.slow
def test_a_server_killed_mid_upload_leaves_no_upload_of_the_finished_run(private_store, tmp_path: Path,
                                                                         monkeypatch) -> None:
    for key, value in private_store.aws_env().items():
        monkeypatch.setenv(key, value)
    s3 = client()
    ensure_bucket(s3)
    url = unique_url()
    loc = parse_s3_url(url)
    stranger_key = loc.key(20, f"attempt-{'0' * 32}/{SHARD}")  # another writer's upload of step 20, live
    stranger = (stranger_key, s3.create_multipart_upload(Bucket=loc.bucket, Key=stranger_key)["UploadId"])

    killed, lock, real_point = threading.Event(), threading.Lock(), upload.point

    def point(label: str, where: str = "") -> None:  # the seam every part crosses: the kill lands mid-upload
        if label == "part" and step_dir_name(20) in where:
            with lock:
                if not killed.is_set():
                    private_store.kill()
                    killed.set()
        real_point(label, where)

    monkeypatch.setattr(upload, "point", point)
    ckpt = Checkpointer(tmp_path / "run", handle_signals=False, mirror=url)
    ckpt.mirror.chunk = PART
    ckpt.save(10, state(10))
    assert ckpt.mirror.wait(HANG_GUARD) and not ckpt.mirror.errors, ckpt.mirror.errors
    # step 20's upload and each of its requests are tried once (no backoff against a dead server)
    settings, s3_client = ckpt.mirror.settings, ckpt.mirror.s3
    ckpt.mirror.settings = dataclasses.replace(settings, attempts=1)
    ckpt.mirror.s3 = client(ckpt.mirror.settings)
    ckpt.save(20, state(20))
    assert killed.wait(HANG_GUARD)
    assert ckpt.mirror.wait(HANG_GUARD)
    assert ckpt.mirror.errors, "the upload of step 20 did not fail with the server down"
    private_store.up()
    ckpt.mirror.settings, ckpt.mirror.s3 = settings, s3_client  # the run goes on as configured
    ours = uploads(s3, loc, 20) - {stranger}
    assert ours, "the kill left no multipart upload of step 20 on the server: the test missed its point"

    ckpt.save(30, state(30))
    ckpt.close()  # returns: step 30 reached the bucket

    assert uploads(s3, loc) == {stranger}  # the run's own upload is gone, the stranger's live one stays
    assert [rs.step for rs in bucketsteps.scan(s3, loc) if rs.has_marker] == [30, 10]
    s3.abort_multipart_upload(Bucket=loc.bucket, Key=stranger[0], UploadId=stranger[1])  # its writer ends it
    assert [rs.step for rs in bucketsteps.scan(s3, loc)] == [30, 10]  # nothing of the abandoned attempt stays
    out = CliRunner().invoke(app, ["status", "--ckpt-dir", url], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "uploads in flight: 0" in out.stdout and "newest complete: 30" in out.stdout, out.stdout

"""Kills of the uploading process against the real S3 server: in the middle of a multipart
upload, and between the last shard (and manifest) and the marker. No reader ever sees the
step complete; the next run finishes the upload (and aborts the dead multipart upload)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers.objstore import aws_env, s3, unique_url  # noqa: F401 - s3 is a fixture
from helpers.procs import REPO, clean_env

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MANIFEST, MARKER, step_dir_name
from slurmresume.mirror import parse_s3_url
from slurmresume.storage import bucketsteps
from slurmresume.storage.s3 import client

SHARD = "rank-00000-of-00001.safetensors"


def big_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(6 << 20, generator=g), "step": step}  # 24 MiB: three 8 MiB parts


def push(root: Path, url: str, step: int, kill_at: str | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env(**aws_env())
    if kill_at:
        env["SLURMRESUME_TEST_KILL_AT"] = kill_at
    return subprocess.run([sys.executable, "-m", "slurmresume.mirror", "push", str(root), url, "--step", str(step)],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


class Watcher:
    """A reader polling the bucket's newest complete step while the uploader runs."""

    def __init__(self, url: str) -> None:
        self.loc, self.seen, self._stop = parse_s3_url(url), set[int](), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        c = client()
        while not self._stop.is_set():
            info = bucketsteps.find_latest(c, self.loc)
            if info is not None:
                self.seen.add(info.step)
            time.sleep(0.05)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def committed(root: Path, *steps: int) -> None:
    ckpt = Checkpointer(root, handle_signals=False)
    for s in steps:
        ckpt.save(s, big_state(s))
    ckpt.close()


@pytest.mark.slow
def test_kill_in_the_middle_of_a_multipart_upload(s3, tmp_path: Path) -> None:
    url, root = unique_url(), tmp_path / "root"
    committed(root, 1, 2)
    loc = parse_s3_url(url)
    assert push(root, url, 1).returncode == 0
    with Watcher(url) as w:
        proc = push(root, url, 2, kill_at="mirror.part:2")  # the second part: the multipart upload exists
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    uploads = s3.list_multipart_uploads(Bucket=loc.bucket, Prefix=loc.step_prefix(2)).get("Uploads") or []
    assert [u["Key"].rsplit("/", 1)[-1] for u in uploads] == [SHARD]  # killed mid-multipart
    assert w.seen <= {1}
    newest = bucketsteps.find_latest(s3, loc)
    assert newest is not None and newest.step == 1
    # the next run: finishes the upload, aborts the dead multipart upload
    again = push(root, url, 2)
    assert again.returncode == 0 and "uploaded" in again.stdout, again.stderr
    assert not s3.list_multipart_uploads(Bucket=loc.bucket, Prefix=loc.step_prefix(2)).get("Uploads")
    newest = bucketsteps.find_latest(s3, loc, verify=True)
    assert newest is not None and newest.step == 2 and newest.verified


@pytest.mark.slow
def test_kill_between_the_last_shard_and_the_marker_then_the_next_run_finishes(s3, tmp_path: Path) -> None:
    url, root = unique_url(), tmp_path / "root"
    committed(root, 1, 2)
    loc = parse_s3_url(url)
    assert push(root, url, 1).returncode == 0
    with Watcher(url) as w:
        proc = push(root, url, 2, kill_at="mirror.marker")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    names = {o["Key"].rsplit("/", 1)[-1] for o in
             s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.step_prefix(2)).get("Contents") or []}
    assert names == {SHARD, "rank-00000.index.json", MANIFEST}  # every file there (format 2: the index too), no marker
    assert w.seen <= {1}
    assert [i.step for i in bucketsteps.list_remote(s3, loc) if i.complete] == [1]
    # the next run (a requeue): restore finds nothing newer on the bucket, and the Checkpointer's
    # mirror finishes the upload of the newest local step in the background
    ckpt = Checkpointer(root, handle_signals=False, mirror=url)
    assert ckpt.restore(big_state(0)) == 2
    ckpt.close()
    assert ckpt.mirror is not None and not ckpt.mirror.errors
    newest = bucketsteps.find_latest(s3, loc, verify=True)
    assert newest is not None and newest.step == 2 and newest.verified
    assert s3.get_object(Bucket=loc.bucket, Key=loc.key(2, MARKER))["Body"].read() == \
        (root / step_dir_name(2) / MARKER).read_bytes()

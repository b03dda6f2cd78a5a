"""The drill with `--mirror`: preempted twice through `submit --local --mirror`, the local root
deleted before the last restart, the run resumes from the bucket and ends bitwise equal to an
uninterrupted run; the bucket's final step is the same bytes too."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.objstore import aws_env, ensure_bucket, unique_url
from helpers.procs import EXAMPLE, REPO, check, clean_env, run_example

from slurmresume.checkpoint.store import find_latest
from slurmresume.mirror import parse_s3_url
from slurmresume.mirror.transfer import download_step
from slurmresume.storage import bucketsteps
from slurmresume.storage.s3 import client
from slurmresume.tools.compare import compare_checkpoints

pytestmark = pytest.mark.slow
ARGS = ("--steps", "30", "--save-every", "5")


def submit_local(root: Path, url: str, drill_at: str | None, max_requeues: int) -> subprocess.CompletedProcess[str]:
    env = clean_env(**aws_env())
    if drill_at:
        env["SLURMRESUME_DRILL_AT"] = drill_at
    return subprocess.run([sys.executable, "-m", "slurmresume", "submit", "--local", str(EXAMPLE), "--ckpt-dir",
                           str(root), "--mirror", url, "--max-requeues", str(max_requeues), "--", *ARGS],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)


def events(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]


def test_drill_with_mirror_resumes_from_the_bucket_after_the_local_root_is_lost(tmp_path: Path,
                                                                              monkeypatch) -> None:
    for key, value in aws_env().items():
        monkeypatch.setenv(key, value)
    s3 = client()
    ensure_bucket(s3)
    url, loc = unique_url(), None
    loc = parse_s3_url(url)
    ref_root, local = tmp_path / "reference", tmp_path / "local"
    check(run_example(ref_root, *ARGS, timeout=600))
    ref = find_latest(ref_root, warn=False)
    assert ref is not None and ref.step == 30

    # run 1: warning at step 8, no requeue allowed: the launcher stops after the save
    first = submit_local(local, url, "8", max_requeues=0)
    saved1 = [e["step"] for e in events(local) if e["event"] == "exit_after_save"]
    assert saved1, first.stdout + first.stderr
    # run 2 (a later "requeue"): resumes locally, uploads what run 1 left, is warned again at 18
    second = submit_local(local, url, "18", max_requeues=0)
    saved2 = [e["step"] for e in events(local) if e["event"] == "exit_after_save"][len(saved1):]
    assert saved2 and saved2[0] > saved1[0], second.stdout + second.stderr
    on_bucket = bucketsteps.find_latest(s3, loc)
    assert on_bucket is not None and on_bucket.step >= saved1[0]

    # the cluster's filesystem is lost between two restarts
    shutil.rmtree(local)
    third = submit_local(local, url, None, max_requeues=2)
    assert third.returncode == 0, third.stdout + third.stderr
    ev = events(local)
    pulled = [e["step"] for e in ev if e["event"] == "mirror_downloaded"]
    restored = [e["step"] for e in ev if e["event"] == "restored"]
    assert pulled and restored and restored[0] == pulled[0] == on_bucket.step > 0

    final = find_latest(local, warn=False)
    assert final is not None and final.step == 30
    assert compare_checkpoints(ref.path, final.path) == []
    # and the run's end reached the bucket, the same commit
    newest = bucketsteps.find_latest(s3, loc, verify=True)
    assert newest is not None and newest.step == 30 and newest.verified
    download_step(s3, loc, 30, tmp_path / "from-bucket")
    assert compare_checkpoints(ref.path, tmp_path / "from-bucket" / final.path.name) == []

"""`submit --mirror` on the real Slurm cluster: the emergency save stays local, the requeued run
uploads it, and the run's final step reaches the bucket bitwise equal to the local one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.objstore import aws_env, ensure_bucket, unique_url
from test_slurm_e2e import SIG_TRAIN, cluster, events, final_state, job_log, preempt_at  # noqa: F401

from slurmresume.checkpoint.store import find_latest
from slurmresume.mirror import parse_s3_url
from slurmresume.mirror.transfer import download_step
from slurmresume.storage import bucketsteps
from slurmresume.storage.s3 import client
from slurmresume.tools.compare import compare_checkpoints

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def test_submit_with_mirror_uploads_the_emergency_step_after_the_requeue(cluster: None, tmp_path: Path,
                                                                         monkeypatch) -> None:
    env = aws_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3 = client()
    ensure_bucket(s3)
    url, root, steps = unique_url(), tmp_path / "run", 40
    out = subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(SIG_TRAIN), "--ckpt-dir", str(root),
                          "--json", "--mirror", url, "--nproc-per-node", "2", "--cpus-per-task", "2", "--time", "10",
                          "--", str(steps), "0.1", "0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)["job_id"]
    preempt_at(root, job, 8, 0, "--signal=USR1")
    assert final_state(job) == "COMPLETED", job_log(root, job)
    ev = events(root)
    saved = [e["step"] for e in ev if e["event"] == "exit_after_save"]
    assert len(saved) == 1
    restart1 = next(i for i, e in enumerate(ev) if e["event"] == "started" and e.get("restart") == 1)
    uploaded = [e["step"] for e in ev[restart1:] if e["event"] == "mirror_uploaded"]
    # The emergency step's upload is not waited for at the exit: the requeued run finishes it, or
    # a newer commit supersedes it while it waits (the uploader keeps only the newest waiting step;
    # a loaded machine makes that likely). Either way the mirror never stays behind the emergency step.
    before = [e["step"] for e in ev[:restart1] if e["event"] == "mirror_uploaded"]
    assert saved[0] in before + uploaded or any(u > saved[0] for u in uploaded), ev
    assert steps in uploaded, ev
    loc = parse_s3_url(url)
    newest = bucketsteps.find_latest(s3, loc, verify=True)
    assert newest is not None and newest.step == steps and newest.verified
    final = find_latest(root, warn=False)
    assert final is not None and final.step == steps
    download_step(s3, loc, steps, tmp_path / "pulled")
    assert compare_checkpoints(final.path, tmp_path / "pulled" / final.path.name) == []

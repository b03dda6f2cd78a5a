"""Once on the real Slurm cluster: the Lightning and HF Trainer examples, submitted with the
real `slurmresume submit`, warned with `scancel --signal=USR1`, requeue once, resume at the
saved step and end bitwise equal to an uninterrupted local run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.integrations import EXAMPLES, events, offline_env
from helpers.procs import signal_tree
from test_slurm_e2e import cluster, final_state, job_log, sacct_states, scancel, submit, wait  # noqa: F401

from slurmresume.checkpoint.store import find_latest
from slurmresume.tools.compare import compare_checkpoints

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ARGS = ("--steps", "16", "--save-every", "2", "--batch-size", "8")


# Lightning is the framework with its own Slurm handling (SLURMEnvironment, its SIGUSR1 requeue),
# so it is the point the real cluster must prove; the HF Trainer's resume is proven by its local
# drill and signal tests, and under Slurm with `bash scripts/test --exhaustive`.
@pytest.mark.parametrize("script", ["lightning_train.py",
                                    pytest.param("hf_trainer_train.py", marks=pytest.mark.exhaustive)])
def test_scancel_usr1_requeues_and_resumes_bitwise(cluster: None, tmp_path: Path, script: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("lightning" if script.startswith("lightning") else "transformers")
    for key, value in offline_env().items():  # the job inherits this environment (HF offline)
        if key.startswith(("HF_", "TRANSFORMERS_")) or key in ("PYTHONPATH", "OMP_NUM_THREADS"):
            monkeypatch.setenv(key, value)
    root = tmp_path / "run"
    job = submit(root, "--time", "15", script=EXAMPLES / script, script_args=(*ARGS, "--step-sleep", "0.5"))
    # the uninterrupted local run, while the job mostly waits (its step sleep, the requeue)
    ref, ref_log = tmp_path / "reference", tmp_path / "reference.log"
    with ref_log.open("w") as log:
        uninterrupted = subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", "--local",
                                          str(EXAMPLES / script), "--ckpt-dir", str(ref), "--", *ARGS],
                                         stdout=log, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        _requeue_once(root, job)
        assert uninterrupted.wait(timeout=900) == 0, ref_log.read_text()[-5000:]
    finally:
        if uninterrupted.poll() is None:  # its ranks are in their own sessions: the whole tree
            signal_tree(uninterrupted.pid, signal.SIGKILL)
    final = find_latest(root, warn=False)
    assert final is not None and final.step == 16
    reference = find_latest(ref, warn=False)
    assert reference is not None and compare_checkpoints(reference.path, final.path) == []


def _requeue_once(root: Path, job: str) -> None:
    """The job: warned after its step 2, requeued once, resumed exactly at the saved step."""
    wait(lambda: (root / "step_000000002" / "COMMITTED").exists(), 400, f"step 2\n{job_log(root, job)}")
    scancel("--signal=USR1", job)
    assert final_state(job, timeout=600) == "COMPLETED", job_log(root, job)
    assert sacct_states(job).count("REQUEUED") == 1, sacct_states(job)
    ev = events(root)
    saved = [e["step"] for e in ev if e["event"] == "exit_after_save"]
    restored = [e["step"] for e in ev if e["event"] == "restored"]
    assert len(saved) == 1 and restored == saved, ev  # resumed exactly at the saved step

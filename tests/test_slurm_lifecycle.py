"""The launcher lifecycle on the real Slurm cluster: a requeue survives a flaky scontrol, the time
limit requeues from the newest complete checkpoint when no new commit can land, and a scancel
during a warned save ends the job for good."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from test_slurm_e2e import (  # noqa: F401
    cluster,
    count,
    events,
    final_state,
    job_log,
    sacct_states,
    scancel,
    submit,
    wait,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

LC_TRAIN = Path(__file__).parent / "helpers" / "lifecycle_train.py"

FLAKY_SCONTROL = """#!/bin/bash
# fails `scontrol requeue` twice (a busy slurmctld), then is the real scontrol
if [ "$1" = requeue ]; then
  n=$(cat "$FLAKY_STATE" 2>/dev/null || echo 0); echo $((n + 1)) > "$FLAKY_STATE"
  if [ "$n" -lt 2 ]; then echo "slurm_requeue error: Socket timed out on send/recv operation" >&2; exit 1; fi
fi
exec {real} "$@"
"""


def progress(root: Path) -> int:
    try:
        return int((root / "pids" / "progress0").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def _submit_with_env(root: Path, env: dict[str, str], *args: str, script_args: tuple[str, ...]) -> str:
    old = dict(os.environ)
    os.environ.update(env)
    try:
        return submit(root, *args, script=LC_TRAIN, script_args=script_args)
    finally:
        os.environ.clear()
        os.environ.update(old)


def test_requeue_survives_a_flaky_scontrol(cluster: None, tmp_path: Path) -> None:  # noqa: F811
    bindir = tmp_path / "bin"
    bindir.mkdir()
    real = shutil.which("scontrol")
    (bindir / "scontrol").write_text(FLAKY_SCONTROL.format(real=real))
    (bindir / "scontrol").chmod(0o755)
    root = tmp_path / "run"
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "FLAKY_STATE": str(tmp_path / "flaky")}
    job = _submit_with_env(root, env, "--time", "10", script_args=("40", "0.1"))
    wait(lambda: progress(root) >= 5, 180, f"step 5\n{job_log(root, job)}")
    scancel("--signal=USR1", job)
    assert final_state(job, timeout=300) == "COMPLETED", job_log(root, job)
    assert (tmp_path / "flaky").read_text().strip() == "3"  # two failures, then the real one
    assert count(root, "requeued") == 1
    req = [e for e in events(root) if e["event"] == "requeued"][0]
    assert req["attempts"] == 3
    assert sacct_states(job).count("REQUEUED") == 1


def test_time_limit_with_a_save_too_slow_resumes_from_previous_checkpoint(cluster: None,  # noqa: F811
                                                                          tmp_path: Path) -> None:
    """Periodic saves every 5 steps; the warning comes, but the save would take 10 minutes; the time
    limit's SIGTERM then requeues from the newest complete checkpoint instead of ending TIMEOUT.
    --time 2: Slurm sends its own --signal warning up to 60 s early (sbatch(1)); with --time 1 and
    --signal-lead 20 it came 9 s into the run, at step 1, before the test's warning at step 7 and
    before any periodic save (a full-suite Slurm run on 2026-12-07: TIMEOUT, nothing to resume)."""
    root = tmp_path / "run"
    env = {"LC_SAVE_EVERY": "5", "LC_SAVE_FAULT": "slow:600", "LC_FAST_AFTER": "1"}
    job = _submit_with_env(root, env, "--time", "2", "--signal-lead", "20", script_args=("400", "0.2"))
    wait(lambda: progress(root) >= 7, 180, f"step 7\n{job_log(root, job)}")
    scancel("--signal=USR1", job)
    wait(lambda: count(root, "signal_agreed") >= 1, 120, "the warned save to start")
    assert final_state(job, timeout=420) == "COMPLETED", job_log(root, job)
    ev = events(root)
    periodic = [e["step"] for e in ev if e["event"] == "save_committed" and e["reason"] == "periodic"
                and e.get("run_id", "").endswith(".0.0")]
    restored = [e["step"] for e in ev if e["event"] == "restored"]
    assert restored and restored[0] == max(periodic), (restored, periodic)
    assert any(e["event"] == "run_ended" and e["outcome"] == "time_limit" for e in ev)
    assert "TIMEOUT" not in sacct_states(job) and "REQUEUED" in sacct_states(job)


def test_scancel_during_a_warned_save_ends_the_job(cluster: None, tmp_path: Path) -> None:  # noqa: F811
    """The warning arrives, the save takes 2 s (within KillWait), the user cancels meanwhile: the
    save may commit, but the job is CANCELLED and never comes back."""
    root = tmp_path / "run"
    job = _submit_with_env(root, {"LC_SAVE_FAULT": "slow:2"}, "--time", "10", script_args=("400", "0.1"))
    wait(lambda: progress(root) >= 5, 180, f"step 5\n{job_log(root, job)}")
    scancel("--signal=USR1", job)
    wait(lambda: count(root, "signal_agreed") >= 1, 120, "the warned save to start")
    scancel(job)
    # final_state waited until the job left squeue (no process of it is left to requeue it: the
    # completing state ends with its last process) and sacct reports it ended; a requeue before
    # that would have put it back in squeue and left a REQUEUED record
    assert final_state(job) == "CANCELLED"
    assert count(root, "requeued") == 0 and count(root, "started") == 1, job_log(root, job)
    assert "REQUEUED" not in sacct_states(job)
    q = subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True)
    assert not q.stdout.strip()

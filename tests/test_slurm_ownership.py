"""One owner per root on the real Slurm cluster (issue #12): resubmitting on the root of a
running job is refused in one line and leaves its checkpoints untouched; once that job is gone
(its launcher SIGKILLed, so it never released its lease) and slurmctld reports it ended on the
lease's cluster, the same command takes the root over, no --takeover (issue #27)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import signal_tree
from test_slurm_e2e import (  # noqa: F401
    SIG_TRAIN,
    cluster,
    count,
    events,
    final_state,
    job_log,
    preempt_at,
    scancel,
    submit,
    wait,
)

from slurmresume.checkpoint.layout import OWNER
from slurmresume.contract import ENV_LEASE_HEARTBEAT

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _submit_raw(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(SIG_TRAIN), "--ckpt-dir", str(root),
                           "--json", *args, "--", "3000", "0.1", "0"], capture_output=True, text=True, timeout=240)


def _owner(root: Path) -> str | None:
    try:
        return json.loads((root / OWNER).read_text())["owner"]
    except (OSError, ValueError, KeyError):
        return None


def _steps(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
            for d in root.glob("step_*") for p in sorted(d.iterdir())}


def _squeue_ids(root: Path | None = None) -> set[str]:
    """The jobs in squeue; with `root`, only those whose batch script lies under it (a submission
    with `--ckpt-dir root` writes its script in root/logs): other tests' jobs share the cluster."""
    out = subprocess.run(["squeue", "-h", "-o", "%i %o"], capture_output=True, text=True).stdout
    rows = [line.split(" ", 1) for line in out.splitlines() if line.strip()]
    return {row[0] for row in rows if root is None or (len(row) == 2 and str(root) in row[1])}


def test_resubmission_on_a_live_root_is_refused_and_takeover_after_it_ended(cluster: None, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the jobs inherit this environment: the killed launcher's lease ages out in 3 s, not 90 s (a
    # live job's lease is judged by its Slurm state, whatever its heartbeat's age)
    monkeypatch.setenv(ENV_LEASE_HEARTBEAT, "1")
    root = tmp_path / "run"
    job = submit(root, "--time", "10", script_args=("3000", "0.1", "0"))
    second = None
    try:
        preempt_at(root, job, 5, 0, "--signal=USR1")  # one committed checkpoint, one requeue
        wait(lambda: count(root, "started", restart=1) >= 1, 180, f"the requeued run\n{job_log(root, job)}")
        assert _owner(root) == f"slurm-{job}"  # the requeued run is the same owner
        before, queued = _steps(root), _squeue_ids(root)
        assert before, "no committed checkpoint to protect"
        assert queued == {job}, queued  # the filter sees this root's job (and so would see a second one)

        res = _submit_raw(root)
        assert res.returncode == 1, res.stdout + res.stderr
        line = res.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line, line
        assert f"Slurm job {job}" in line and "since" in line and "refusing to start a second writer" in line, line
        assert _squeue_ids(root) == {job}  # nothing submitted
        assert count(root, "submitted") == 1
        res = _submit_raw(root, "--takeover")  # a live owner is never taken over
        assert res.returncode == 1 and "refusing to start a second writer" in res.stderr, res.stderr
        assert _steps(root) == before and _owner(root) == f"slurm-{job}"

        # the node dies: SIGKILL the launcher's whole process tree at once (walked through /proc,
        # as a dead node gives no process a chance to run a handler), so the lease is never
        # released; the job then leaves squeue. (`scancel --signal=KILL` is not this: Slurm
        # delivered SIGTERM to the launcher here, which then ends the run and frees the root.)
        launcher = [e["pid"] for e in events(root) if e.get("event") == "started"][-1]
        signal_tree(launcher, signal.SIGKILL)
        wait(lambda: job not in _squeue_ids(), 120, f"job {job} to leave squeue")
        assert _owner(root) == f"slurm-{job}"
        res = _submit_raw(root)  # strong proof (ended on this cluster): the same command, no flag
        assert res.returncode == 0, res.stderr
        assert f"took over {root} from Slurm job {job}" in res.stderr and "has ended" in res.stderr, res.stderr
        second = json.loads(res.stdout)["job_id"]
        assert _owner(root) == f"slurm-{second}"
        wait(lambda: count(root, "restored", run_id=f"slurm-{second}.0.0") >= 1, 180,
             f"job {second} to resume\n{job_log(root, second)}")
        assert _steps(root).items() >= before.items()  # the first job's checkpoints are still there
    finally:
        for j in (job, second):
            if j:
                subprocess.run(["scancel", j], check=False)
        for j in (job, second):
            if j:
                final_state(j)

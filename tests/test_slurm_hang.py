"""A hang under the real Slurm cluster (`scripts/cluster.sh up`): detected, every rank's stacks
dumped, restarted inside the allocation (no requeue), the job completes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm_e2e import cluster, events, final_state, job_log, sacct_states  # noqa: F401 (cluster: fixture)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

HANG_TRAIN = Path(__file__).resolve().parent / "helpers" / "hang_train.py"


def test_hang_restarts_inside_the_allocation(cluster: None, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    env = {**os.environ, "SLURMRESUME_DRILL_HANG": "1:12", "PIDDIR": str(root / "pids")}
    out = subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(HANG_TRAIN), "--ckpt-dir", str(root),
                          "--nproc-per-node", "2", "--hang-timeout", "4", "--max-hangs", "1", "--json", "--",
                          "40", "0.05", "-1", "1", "0", "5"], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    job = __import__("json").loads(out.stdout)["job_id"]
    assert final_state(job, timeout=300) == "COMPLETED", job_log(root, job)
    ev = events(root)
    (hang,) = [e for e in ev if e["event"] == "hang"]
    assert hang["ranks"] == [1] and hang["step"] == 11 and hang["run_id"] == f"slurm-{job}.0.0", job_log(root, job)
    folder = Path(hang["dump_dir"])
    assert folder.parent == root / "logs" / f"slurm-{job}.0.0"
    assert sorted(p.name for p in folder.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert "drill_hang_here" in (folder / "rank-1.txt").read_text()
    assert [e["cause"] for e in ev if e["event"] == "resumed"] == ["hang"]
    assert not any(e["event"] == "requeued" for e in ev)
    assert len(sacct_states(job)) == 1  # one Slurm run: the restart happened inside the allocation
    assert any(e["event"] == "finished" and e["step"] == 40 for e in ev)

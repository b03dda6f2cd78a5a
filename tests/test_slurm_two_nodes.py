"""Two emulated Slurm nodes x 1 process, c10d rendezvous across them: one preemption, both
shards under one marker, exactly one requeue (by the first node), resume and finish.

Switches the cluster to two nodes for this module and back to one afterwards."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from slurmresume.checkpoint.store import find_latest

from .test_slurm_e2e import REPO, count, events, final_state, job_log, preempt_at, submit

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes(cluster: None):
    """The cluster to itself (restarting the daemons kills every other test's job) from the
    switch to two nodes until it is back to one."""
    from helpers.cluster_lock import cluster_lock

    with cluster_lock(exclusive=True):
        up = subprocess.run(["bash", str(REPO / "scripts" / "cluster.sh"), "up", "--nodes", "2"],
                            capture_output=True, text=True)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield
        back = subprocess.run(["bash", str(REPO / "scripts" / "cluster.sh"), "up", "--nodes", "1"],
                              capture_output=True, text=True)
        assert back.returncode == 0, back.stdout[-3000:]


from .test_slurm_e2e import cluster  # noqa: E402,F401  (the module fixture above depends on it)


@pytest.mark.slurm_exclusive
def test_two_nodes_preempt_once(two_nodes: None, tmp_path: Path) -> None:
    root = tmp_path / "run"
    # --shared-root: both emulated nodes run on this host, whose local disk they share
    job = submit(root, "--nodes", "2", "--shared-root", "--nproc-per-node", "1", "--time", "10",
                 script_args=("60", "0.1", "0"))
    preempt_at(root, job, 6, 0, "--signal=USR1")
    assert final_state(job, timeout=300) == "COMPLETED", job_log(root, job)
    assert count(root, "requeued") == 1
    saved = [e["step"] for e in events(root) if e["event"] == "exit_after_save"]
    assert len(saved) == 1
    manifest = json.loads((root / f"step_{saved[0]:09d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    nodes_started = {e.get("node") for e in events(root) if e["event"] == "started"}
    assert nodes_started == {0, 1}
    assert find_latest(root, warn=False).step == 60

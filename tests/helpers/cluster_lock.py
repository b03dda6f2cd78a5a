"""One real Slurm cluster, several pytest-xdist workers: a readers-writer lock across processes.

Most end-to-end tests submit small jobs (1-2 of the node's 8 advertised CPUs) and can share the
cluster; they take it shared, the two-node tests too on the full suite's two-node cluster
(scripts/test). A few cannot share it: the partition-preemption tests need the whole cluster (a
`high` job would also preempt the other tests' jobs), and on a one-node cluster the two-node
module restarts the daemons to switch it to two nodes and back. They take it exclusively (marker
`slurm_exclusive`, or `cluster_lock(exclusive=True)` around a fixture). The resubmission test (test_slurm_ownership.py) shares it: it checks that
nothing was queued for its own root, not that nothing else entered squeue.

flock alone lets new shared holders in while an exclusive one waits, so an exclusive test
could wait for a whole chain of shared ones; a turnstile (taken briefly by readers, held by a
waiting writer) gives the writer its turn at the end of the tests already running."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_DIR = Path(os.environ.get("SLURMRESUME_TEST_LOCK_DIR", "/tmp/slurmresume-test-cluster"))
_held: list[bool] = []  # this process's holds, outermost first (a fixture, then its test)


@contextlib.contextmanager
def cluster_lock(exclusive: bool = False) -> Iterator[None]:
    """Hold the cluster shared (or exclusively) for the block. Re-entrant in one process: an
    inner request is satisfied by an outer hold of at least the same strength."""
    if _held and (_held[0] or not exclusive):
        yield
        return
    if _held:  # shared outside, exclusive asked inside: a mistake in the tests, not a wait
        raise RuntimeError("cluster_lock: asked for exclusive inside a shared hold")
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    gate = os.open(LOCK_DIR / "turnstile", os.O_RDWR | os.O_CREAT, 0o666)
    main = os.open(LOCK_DIR / "cluster", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if exclusive:
            fcntl.flock(main, fcntl.LOCK_EX)  # readers queue at the gate meanwhile
        else:
            fcntl.flock(gate, fcntl.LOCK_UN)
            fcntl.flock(main, fcntl.LOCK_SH)
        fcntl.flock(gate, fcntl.LOCK_UN)
        _held.append(exclusive)
        try:
            yield
        finally:
            _held.pop()
    finally:
        os.close(main)  # closing drops the flock
        os.close(gate)

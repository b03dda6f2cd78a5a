"""The test suite's own readers-writer lock on the shared Slurm cluster (helpers/cluster_lock.py):
shared holders overlap, an exclusive one waits for them and then holds it alone, and shared
requests made while it waits queue behind it (no starvation by a chain of shared tests)."""

from __future__ import annotations

import multiprocessing as mp
import time
from pathlib import Path

import pytest
from helpers import cluster_lock as cl


def _hold(lock_dir: str, exclusive: bool, seconds: float, log: mp.Queue, name: str) -> None:
    cl.LOCK_DIR = Path(lock_dir)
    with cl.cluster_lock(exclusive=exclusive):
        log.put((name, "in", time.monotonic()))
        time.sleep(seconds)
        log.put((name, "out", time.monotonic()))


def test_shared_overlap_exclusive_waits_and_goes_before_later_shared(tmp_path: Path) -> None:
    ctx = mp.get_context("fork")
    log: mp.Queue = ctx.Queue()
    procs = []
    # wide margins: the writer asks 0.7 s after r1, r3 1.5 s after the writer, r1 holds 3 s (a
    # loaded machine may start a forked child late)
    for name, exclusive, hold, start_after in [("r1", False, 3.0, 0.0), ("r2", False, 3.0, 0.2),
                                                ("w", True, 0.8, 0.7), ("r3", False, 0.3, 2.2)]:
        time.sleep(start_after - (procs[-1][1] if procs else 0.0))
        p = ctx.Process(target=_hold, args=(str(tmp_path), exclusive, hold, log, name))
        p.start()
        procs.append((p, start_after))
    for p, _ in procs:
        p.join(20)
        assert p.exitcode == 0
    ev = {}
    while not log.empty():
        name, what, t = log.get()
        ev[(name, what)] = t
    assert ev[("r2", "in")] < ev[("r1", "out")]  # shared holders overlap
    assert ev[("w", "in")] >= max(ev[("r1", "out")], ev[("r2", "out")])  # exclusive waits for both
    assert ev[("r3", "in")] >= ev[("w", "out")]  # asked while the writer waited: after it


def test_reentrant_in_one_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cl, "LOCK_DIR", tmp_path)
    with cl.cluster_lock(exclusive=True), cl.cluster_lock(exclusive=True), cl.cluster_lock():
        pass
    with cl.cluster_lock(), pytest.raises(RuntimeError), cl.cluster_lock(exclusive=True):
        pass

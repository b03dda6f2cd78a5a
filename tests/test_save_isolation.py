"""A save never operates on a directory it did not create, and never waits behind a prune
(issue #12): two writers of one step cannot destroy each other's committed step; a root lock
held by another process (a prune) does not delay an emergency save; prune plans without it."""

from __future__ import annotations

import errno
import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.core import model_equal, restore_fresh, step_dir, tiny_model, tiny_state, warn_self

import slurmresume.checkpoint.commit as commit_mod
from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import LOCK, MARKER, saving_dirs
from slurmresume.checkpoint.store import inspect_dir, list_checkpoints
from slurmresume.errors import SaveError
from slurmresume.retention import RetentionPolicy, execute

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")


def _interleave(monkeypatch: pytest.MonkeyPatch, other: Checkpointer, step: int, fail: bool) -> None:
    """While the first writer streams its shard of `step`, `other` saves and commits the same
    step completely (the second job on a shared root). With `fail`, the first writer's shard
    write then fails (ENOSPC), so its save is abandoned."""
    real = commit_mod.write_shard
    state = {"armed": True}

    def write_shard(*args, **kwargs):
        if state["armed"]:
            state["armed"] = False
            assert other.save(step, tiny_state(100 + step)) is not None  # the other writer commits
            if fail:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(commit_mod, "write_shard", write_shard)


def test_a_failing_writer_cannot_destroy_anothers_committed_step(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "root"
    first, second = Checkpointer(root, handle_signals=False), Checkpointer(root, handle_signals=False)
    first.save(1, tiny_state(1))
    _interleave(monkeypatch, second, 5, fail=True)
    with pytest.raises(SaveError, match="no space left"):
        first.save(5, tiny_state(5))
    info = inspect_dir(5, step_dir(root, 5), verify=True)
    assert info.complete and info.verified, info.problem  # the other writer's commit survives
    step, state = restore_fresh(root)
    assert step == 5 and model_equal(state["model"], tiny_model(105))
    assert saving_dirs(root) == []  # the failed save removed its own directory, nothing else


def test_two_writers_of_one_step_one_wins_and_the_disk_says_which(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "root"
    first, second = Checkpointer(root, handle_signals=False), Checkpointer(root, handle_signals=False)
    _interleave(monkeypatch, second, 7, fail=False)
    with pytest.raises(SaveError, match="committed .* by another writer"):
        first.save(7, tiny_state(7))
    step, state = restore_fresh(root)
    assert step == 7 and model_equal(state["model"], tiny_model(107))  # the writer told "saved"
    assert inspect_dir(7, step_dir(root, 7), verify=True).verified
    assert saving_dirs(root) == []


HOLDER = """
import sys, time
from filelock import FileLock
lock = FileLock(sys.argv[1]); lock.acquire()
print("held", flush=True); time.sleep(120)
"""


@pytest.fixture
def held_lock(tmp_path: Path):
    """Another process (a prune, say) holds the root's lock for two minutes."""
    root = tmp_path / "root"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        yield root
    finally:
        holder.kill()
        holder.wait()


def _timed(fn, bound: float):
    """Run fn in a thread; (result, seconds), or fail once `bound` is passed (the old code
    would block for 120 s in the root lock)."""
    out: dict = {}

    def run() -> None:
        started = time.monotonic()
        out["result"] = fn()
        out["seconds"] = time.monotonic() - started

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound)
    assert "seconds" in out, f"still blocked after {bound} s"
    return out["result"], out["seconds"]


def test_emergency_save_does_not_wait_behind_a_held_root_lock(held_lock: Path) -> None:
    root = held_lock
    ckpt = Checkpointer(root, exit_on_signal=False, retention=RetentionPolicy(keep=1))
    try:
        warn_self(ckpt)  # the warning: the next step() saves and returns True
        acted, seconds = _timed(lambda: ckpt.step(3, tiny_state(3)), bound=20)
        assert acted is True and seconds < 5, seconds
        assert (step_dir(root, 3) / MARKER).exists() and ckpt.last_saved_step == 3
    finally:
        ckpt.close()


def test_periodic_save_with_retention_does_not_stall_behind_a_held_lock(held_lock: Path) -> None:
    root = held_lock
    ckpt = Checkpointer(root, handle_signals=False, retention=RetentionPolicy(keep=1))
    for s in (1, 2):
        _, seconds = _timed(lambda s=s: ckpt.save(s, tiny_state(s)), bound=20)
        assert seconds < 5, seconds  # retention skipped this round (lock busy) after a short wait
    assert sorted(i.step for i in list_checkpoints(root) if i.complete) == [1, 2]
    ckpt.close()


def test_prune_plans_without_holding_the_lock(tmp_path: Path, monkeypatch) -> None:
    root = tmp_path / "root"
    ckpt = Checkpointer(root, handle_signals=False)
    for s in (1, 2, 3):
        ckpt.save(s, tiny_state(s))
    import slurmresume.retention as retention

    real_scan, free_during_scan = retention.scan, []

    def slow_scan(path: Path):
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:  # is the lock free while prune plans?
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            free_during_scan.append(True)
        except BlockingIOError:
            free_during_scan.append(False)
        finally:
            os.close(fd)
        return real_scan(path)

    monkeypatch.setattr(retention, "scan", slow_scan)
    result = execute(root, RetentionPolicy(keep=1))
    assert free_during_scan == [True]
    assert sorted(result.deleted) == ["step_000000001", "step_000000002"]
    assert [i.step for i in list_checkpoints(root)] == [3]

"""Guards: one fast test per single-line breakage that used to pass the quick lane (issue 34).

Each test asserts on the effect the guarded line exists for (the fd that `os.fsync` received, a
lease file's bytes, the next random numbers of a rank, the step a restore lands on, the kind of an
agreed signal, which directories survive a prune), never on log text. Multi-rank guards run three
forked ranks over gloo (`run_ranks`, under a second): with the largest value on the middle rank,
MIN, "rank 0's value" and "the last rank's value" all differ from MAX, and a rank beyond a saved
world of two exists only with three.

Each guard was seen to fail with its breakage (the table above) applied alone, and to pass
without it.

  breakage (one line)                                              guard
  1 fsio.fsync_dir: the label, no os.fsync                        test_fsync_dir_*, test_a_save_fsyncs_*
  2 ownership.acquire: without `.owner.json.lock`                  test_acquire_waits_for_the_lease_lock
  3 restoreapply.apply_loaded: rank >= saved world not re-seeded   test_a_rank_beyond_the_saved_world_*
  4 ownership.refresh: rewrites a lease naming another owner       test_refresh_*, test_holder_*
  5 restorechoice.choose: no whole-shard check w/o block digests  test_a_checkpoint_without_block_digests_*
  6 SignalFlag._record: the last signal wins, not the strongest    test_two_signals_*
  7 collective: MIN instead of MAX in the agreement                test_the_agreement_is_the_max_*
  8 retention.execute: victims not re-checked under the lock       test_prune_rechecks_*
  9 commit.commit: marker not withdrawn after a failed publish     test_a_save_that_fails_after_publishing_*
 10 store.check_checksums: header/skeleton structure not checked   test_verify_refuses_*
 11 StepBoundary.decide: time save not re-posted after a failure   test_rank_0_posts_a_time_based_save_again_*
"""

from __future__ import annotations

import errno
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import struct
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from filelock import FileLock
from helpers.core import model_equal, restore_fresh, save_steps, step_dir, tiny_model, tiny_state
from typer.testing import CliRunner

from slurmresume import Checkpointer, ownership
from slurmresume.checkpoint import fsio
from slurmresume.checkpoint.layout import INPROGRESS, MARKER, OWNER_LOCK, shard_name
from slurmresume.checkpoint.manifest import read_manifest
from slurmresume.checkpoint.store import find_latest, inspect_dir
from slurmresume.errors import SaveError
from slurmresume.events import read_events
from slurmresume.retention import RetentionPolicy, execute
from slurmresume.train import rng
from slurmresume.train.signals import NONE, PREEMPT, TERMINATE, SignalFlag

WORLD = 3


# -- three ranks, forked, over gloo ----------------------------------------------------------------

def run_ranks(tmp_path: Path, body: Callable[[int], Any], world: int = WORLD, timeout: float = 60.0) -> list[Any]:
    """Fork `world` ranks that join one gloo group (file store under `tmp_path`), run `body(rank)`
    and return its JSON-able result; returns the results by rank. Forked from the test process,
    so torch is already imported: the whole round costs well under a second."""
    where = tmp_path / f"ranks-{time.monotonic_ns()}"
    where.mkdir()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main, args=(r, world, where, body)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = [(where / f"{r}.err").read_text() for r in range(world) if (where / f"{r}.err").exists()]
    assert not hung and not errors, (f"{len(hung)} rank(s) hung", errors)
    assert [p.exitcode for p in procs] == [0] * world
    return [json.loads((where / f"{r}.json").read_text()) for r in range(world)]


def _rank_main(rank: int, world: int, where: Path, body: Callable[[int], Any]) -> None:
    code = 1
    try:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{where / 'store'}", rank=rank, world_size=world)
        result = body(rank)
        dist.barrier()  # nobody leaves while a peer is still in a collective
        (where / f"{rank}.json").write_text(json.dumps(result))
        code = 0
    except BaseException:  # noqa: BLE001 - reported by the parent, never raised into pytest's fork
        (where / f"{rank}.err").write_text(traceback.format_exc())
    finally:
        os._exit(code)


# -- 1. directory fsyncs reach the disk --------------------------------------------------------------

@dataclass(frozen=True)
class Fsync:
    path: str  # what the fd refers to (/proc/self/fd), at the moment of the call
    inode: tuple[int, int]
    entries: frozenset[str]  # the entries of the directory (for a file: of its directory) then


def record_fsyncs(monkeypatch: pytest.MonkeyPatch) -> list[Fsync]:
    """Every os.fsync of this process from now on, with the file or directory its fd refers to."""
    seen: list[Fsync] = []
    real = os.fsync

    def spy(fd: Any) -> None:
        fd = fd if isinstance(fd, int) else fd.fileno()
        path = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
        entries = frozenset(os.listdir(path if os.path.isdir(path) else os.path.dirname(path)))
        seen.append(Fsync(path, (st.st_dev, st.st_ino), entries))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    return seen


def _inode(path: Path) -> tuple[int, int]:
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def test_fsync_dir_fsyncs_that_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = record_fsyncs(monkeypatch)
    fsio.fsync_dir(tmp_path, "root")
    # (a lease heartbeat an earlier test left running fsyncs its own root's files meanwhile)
    ours = [(s.path, s.inode) for s in seen if s.path.startswith(str(tmp_path.resolve()))]
    assert ours == [(str(tmp_path.resolve()), _inode(tmp_path))]


@pytest.mark.parametrize("how", ["save", "save_async"])
def test_a_save_fsyncs_every_file_its_step_directory_and_the_root_after_publishing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """DESIGN.md section 1: every file of a step is durable before the marker counts, the step
    directory once the marker is in it, and the root once the step is published under its name.
    A rename alone is not durable: without the directory fsyncs a power cut can lose a step the
    run was told is committed (and that retention already counted)."""
    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, handle_signals=False)
    seen = record_fsyncs(monkeypatch)
    getattr(ckpt, how)(3, tiny_state(3))
    ckpt.wait()  # the background writer's fsyncs are recorded too
    monkeypatch.undo()
    ckpt.close()
    d = step_dir(root, 3)
    for f in sorted(d.iterdir()):
        first = next((i for i, s in enumerate(seen) if s.inode == _inode(f)), None)
        assert first is not None, f"{f.name} of the committed step was never fsynced"
        if f.name != MARKER:
            assert MARKER not in seen[first].entries, f"{f.name} was first fsynced after the marker existed"
    step_synced = [i for i, s in enumerate(seen) if s.inode == _inode(d) and MARKER in s.entries]
    assert step_synced, "the step directory was not fsynced after its commit marker was written into it"
    root_synced = [i for i, s in enumerate(seen) if s.inode == _inode(root) and d.name in s.entries]
    assert root_synced, "the root was not fsynced after the step was published under its name"
    assert max(root_synced) > min(step_synced)  # the publishing rename made durable last


# -- 2, 4. the ownership lease ----------------------------------------------------------------------

def _lease_bytes(root: Path) -> bytes | None:
    path = ownership.lease_path(root)
    return path.read_bytes() if path.exists() else None


@pytest.mark.parametrize("before", [None, "local-gone"], ids=["no-lease", "lease-of-a-gone-owner"])
def test_acquire_waits_for_the_lease_lock_and_writes_nothing_without_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before: str | None) -> None:
    """The read-modify-write of the lease is under `.owner.json.lock` where flock works: two
    launchers started together must not both read "free" and both write themselves in."""
    if before is not None:
        ownership.acquire(tmp_path, before)  # this process: judged gone, so a takeover may take it
    old = _lease_bytes(tmp_path)
    monkeypatch.setattr(ownership, "LOCK_WAIT_S", 0.3)
    held = FileLock(str(tmp_path / OWNER_LOCK))
    held.acquire()
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            ownership.acquire(tmp_path, "local-new", takeover=True)
        assert time.monotonic() - started >= 0.25  # it waited for the lock
        assert _lease_bytes(tmp_path) == old  # and wrote nothing
    finally:
        held.release()
    assert ownership.acquire(tmp_path, "local-new", takeover=True).owner == "local-new"  # the lock was all
    assert ownership.read_lease(tmp_path).owner == "local-new"  # type: ignore[union-attr]


def test_refresh_never_rewrites_a_lease_that_now_names_another_owner(tmp_path: Path) -> None:
    ownership.acquire(tmp_path, "local-a")
    ownership.acquire(tmp_path, "local-b", takeover=True)  # b took the root over from a
    taken = _lease_bytes(tmp_path)
    assert ownership.refresh(tmp_path, "local-a") is False
    assert _lease_bytes(tmp_path) == taken
    time.sleep(0.01)
    assert ownership.refresh(tmp_path, "local-b") is True  # the owner's own refresh still works
    after = ownership.read_lease(tmp_path)
    assert after is not None and after.owner == "local-b" and after.heartbeat > json.loads(taken or b"{}")["heartbeat"]


def test_holder_learns_that_its_lease_was_taken_over(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ownership, "HEARTBEAT_S", 0.05)
    ownership.acquire(tmp_path, "local-a")
    holder = ownership.Holder(tmp_path, "local-a")
    try:
        time.sleep(0.2)
        assert not holder.lost  # its own lease: refreshed, not lost
        ownership.acquire(tmp_path, "local-b", takeover=True)
        taken = _lease_bytes(tmp_path)
        deadline = time.monotonic() + 5
        while not holder.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert holder.lost
        time.sleep(0.2)  # further beats (if any) must leave the new owner's lease alone
        assert _lease_bytes(tmp_path) == taken
    finally:
        holder.stop()


# -- 3. a rank beyond the saved world size gets fresh, derived RNG streams --------------------------

def _draws() -> list[float]:
    return [random.random(), float(np.random.rand()), *torch.rand(2).tolist()]


def test_a_rank_beyond_the_saved_world_is_reseeded_from_step_and_rank(tmp_path: Path) -> None:
    """Two ranks save step 5 (replicated model, per-rank RNG); three resume. Ranks 0 and 1 continue
    their saved streams; rank 2 has none and gets fresh ones derived from (step, rank), not
    whatever it drew before restoring and not a clone of another rank's."""
    root = tmp_path / "ckpt"

    def save(rank: int) -> list[float]:
        random.seed(100 + rank)
        np.random.seed(100 + rank)
        torch.manual_seed(100 + rank)
        ckpt = Checkpointer(root, handle_signals=False)
        ckpt.save(5, tiny_state(5))
        ckpt.close()
        return _draws()  # what this rank's saved streams give next

    saved = run_ranks(tmp_path, save, world=2)

    def resume(rank: int) -> dict[str, Any]:
        random.seed(900 + rank)  # whatever the script had before restoring
        np.random.seed(900 + rank)
        torch.manual_seed(900 + rank)
        ckpt = Checkpointer(root, handle_signals=False)
        state = tiny_state(0)
        step = ckpt.restore(state)
        got = _draws()
        ckpt.close()
        weights = model_equal(state["model"], tiny_model(5))  # (building a model draws from torch)
        rng.reseed(5, rank)  # the documented rule for a rank with no saved state
        return {"step": step, "weights": weights, "got": got, "reseeded": _draws()}

    ranks = run_ranks(tmp_path, resume)
    assert [r["step"] for r in ranks] == [5] * WORLD and all(r["weights"] for r in ranks)
    assert [ranks[0]["got"], ranks[1]["got"]] == saved  # their own saved streams
    assert ranks[2]["got"] == ranks[2]["reseeded"]  # rank 2 >= saved world 2: fresh, derived streams
    assert ranks[2]["got"] not in saved  # not a clone of another rank's stream


# -- 5. a checkpoint written before per-block digests is checked whole before it loads ------------

def _flip_a_weight_byte(shard: Path) -> None:
    data = bytearray(shard.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in sorted(header) if k != "__metadata__" and "weight" in k)
    start = 8 + n + header[name]["data_offsets"][0]
    data[start + 1] ^= 0x40
    shard.write_bytes(bytes(data))


def _as_older_format(d: Path) -> None:
    """What a version before per-block digests wrote: no `verify_block`, no header digest (a
    format-2 shard table, whose rows may lack it)."""
    from helpers.core import rewrite_manifest

    def edit(m: dict) -> None:
        m.pop("verify_block", None)
        m["format"] = "slurmresume/2"
        for s in m["shards"]:
            s.pop("header_xxh3", None)

    rewrite_manifest(d, edit)
    assert not read_manifest(d, int(d.name.removeprefix("step_"))).has_block_digests


@pytest.mark.parametrize("flip", [False, True], ids=["intact", "flipped-byte"])
def test_a_checkpoint_without_block_digests_is_checked_whole_and_falls_back(tmp_path: Path, flip: bool) -> None:
    save_steps(tmp_path, [1, 2]).close()
    d = step_dir(tmp_path, 2)
    _as_older_format(d)
    if flip:
        _flip_a_weight_byte(d / shard_name(0, 1))
    step, state = restore_fresh(tmp_path)
    assert step == (1 if flip else 2)
    assert model_equal(state["model"], tiny_model(step))


# -- 6. two signals before a step boundary: the strongest request stands ---------------------------

def _send_and_wait(flag: SignalFlag, sigs: list[signal.Signals]) -> None:
    for i, s in enumerate(sigs, 1):
        os.kill(os.getpid(), s)
        deadline = time.monotonic() + 10
        while len(flag.received) < i and time.monotonic() < deadline:
            time.sleep(0.002)  # one after the other: the order is the point
        assert len(flag.received) == i, f"signal {s.name} never reached the flag"


ORDERS = [[signal.SIGUSR1, signal.SIGTERM], [signal.SIGTERM, signal.SIGUSR1]]


@pytest.mark.parametrize("sigs", ORDERS, ids=["warn-then-term", "term-then-warn"])
def test_two_signals_leave_the_stronger_request(sigs: list[signal.Signals]) -> None:
    flag = SignalFlag(signal.SIGUSR1)
    assert flag.install()
    try:
        _send_and_wait(flag, sigs)
        assert flag.request == PREEMPT  # the warning (save, requeue) beats SIGTERM (save, stop)
    finally:
        flag.uninstall()
    assert PREEMPT > TERMINATE > NONE


@pytest.mark.parametrize("sigs", ORDERS, ids=["warn-then-term", "term-then-warn"])
def test_two_signals_before_a_step_save_as_a_preemption(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        sigs: list[signal.Signals]) -> None:
    """What the request decides: a preemption is saved and requeued; a plain SIGTERM is not."""
    monkeypatch.delenv("SLURMRESUME_SIGNAL", raising=False)
    ckpt = Checkpointer(tmp_path, exit_on_signal=False)
    try:
        assert ckpt.flag is not None
        _send_and_wait(ckpt.flag, sigs)
        assert ckpt.step(1, tiny_state(1)) is True
    finally:
        ckpt.close()
    kinds = {e["event"]: e.get("kind") for e in read_events(tmp_path) if e.get("step") == 1}
    assert kinds.get("signal_agreed") == "preempt" and kinds.get("exit_after_save") == "preempt", kinds
    assert (step_dir(tmp_path, 1) / MARKER).exists()


# -- 7, 11. the per-step agreement across ranks ----------------------------------------------------

def test_the_agreement_is_the_max_over_ranks(tmp_path: Path) -> None:
    """A warning that reached one rank only (here rank 1 of 3) makes every rank save that step."""

    def body(rank: int) -> dict[str, Any]:
        from slurmresume.checkpoint.collective import Group, LaggedMax
        from slurmresume.train.verdict import StepBoundary

        group = Group.create()
        values = [1, 3, 2]  # the largest on a middle rank: MIN, first or last would all differ
        out: dict[str, Any] = {"max_int": group.max_int(values[rank])}
        lagged = LaggedMax(group)
        out["lagged"] = [lagged.exchange(values[rank]), lagged.exchange(0)]
        flag = SimpleNamespace(request=PREEMPT if rank == 1 else NONE)
        boundary = StepBoundary(group, flag, None)  # type: ignore[arg-type]
        out["signal"] = [boundary.decide(step, None).signal for step in (1, 2)]
        boundary.drain()
        group.destroy()
        return out

    for rank, got in enumerate(run_ranks(tmp_path, body)):
        assert got["max_int"] == 3, (rank, got)
        assert got["lagged"] == [0, 3], (rank, got)  # the step after it was posted, on every rank
        assert got["signal"][-1] == PREEMPT, (rank, got)


def test_rank_0_posts_a_time_based_save_again_after_a_failed_one(tmp_path: Path) -> None:
    """Rank 0's clock says a save is due at every step (each save fails, so it stays due): the
    ranks must keep agreeing on saves, not stop after the first failure for the rest of the run."""

    def body(rank: int) -> list[int]:
        from slurmresume.checkpoint.collective import Group
        from slurmresume.train.verdict import StepBoundary

        group = Group.create()
        boundary = StepBoundary(group, None, None)
        saves = []
        for step in range(1, 9):
            verdict = boundary.decide(step, "seconds" if rank == 0 else None)
            if verdict.save is not None:
                saves.append(step)  # ... and it fails: boundary.saved() is never called
        boundary.drain()
        group.destroy()
        return saves

    ranks = run_ranks(tmp_path, body)
    assert ranks[0] == ranks[1] == ranks[2], ranks  # every rank saves the same steps
    assert len(ranks[0]) >= 3 and ranks[0][0] <= 2, ranks


# -- 8. prune re-checks each victim under the lock ------------------------------------------------

def _age(path: Path, seconds: float) -> None:
    t = time.time() - seconds
    for p in [*path.iterdir(), path]:
        os.utime(p, (t, t))


def test_prune_rechecks_an_incomplete_victim_a_writer_took_up_since_the_plan(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2]).close()
    stale = step_dir(tmp_path, 5)
    stale.mkdir()
    (stale / shard_name(0, 1)).write_bytes(b"x" * 64)
    _age(stale, 7200)
    note = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}

    def writer_starts(i: int, n: int) -> None:  # between the plan and the renames
        (stale / INPROGRESS).write_text(json.dumps(note))

    result = execute(tmp_path, RetentionPolicy(keep=2, remove_incomplete_older_than=3600), progress=writer_starts)
    assert stale.is_dir() and (stale / INPROGRESS).exists()
    assert result.deleted == [] and [name for name, _ in result.skipped] == [stale.name]


def test_prune_rechecks_a_complete_victim_when_the_newest_went_since_the_plan(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2, 3]).close()
    newest = step_dir(tmp_path, 3)

    def newest_goes(i: int, n: int) -> None:  # another prune, or a user, removes the newest
        if newest.exists():
            newest.rename(tmp_path / ".deleting.by-someone-else")

    result = execute(tmp_path, RetentionPolicy(keep=1), progress=newest_goes)
    assert step_dir(tmp_path, 1).is_dir() and step_dir(tmp_path, 2).is_dir()
    assert result.deleted == []
    latest = find_latest(tmp_path, verify=True)
    assert latest is not None and latest.step == 2  # the root still holds a complete checkpoint


# -- 9. a save that fails after publishing takes its marker back ----------------------------------

@pytest.mark.parametrize("rename_back", ["works", "fails"])
def test_a_save_that_fails_after_publishing_leaves_no_committed_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rename_back: str) -> None:
    """The root's fsync after the publishing rename fails: the caller is told the save failed, so
    no reader may count that step, even when the directory cannot be taken back."""
    ckpt = save_steps(tmp_path, [1])
    published = step_dir(tmp_path, 2) / MARKER
    real_fsync_dir, real_rename = fsio.fsync_dir, os.rename

    def fsync_dir(path: Path, label: str) -> None:
        if label == "root" and published.exists():
            raise OSError(errno.EIO, "injected I/O error", str(path))
        real_fsync_dir(path, label)

    def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        if Path(src) == published.parent:
            raise OSError(errno.EIO, "injected I/O error", str(src))
        real_rename(src, dst, *a, **k)

    monkeypatch.setattr(fsio, "fsync_dir", fsync_dir)
    if rename_back == "fails":
        monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(SaveError, match="injected I/O error"):
        ckpt.save(2, tiny_state(2))
    monkeypatch.undo()
    ckpt.close()
    assert not published.exists()
    assert not inspect_dir(2, step_dir(tmp_path, 2)).complete
    step, state = restore_fresh(tmp_path)
    assert step == 1 and model_equal(state["model"], tiny_model(1))


# -- 10. verify checks what a restore would refuse, not only the checksums -------------------------

@pytest.mark.parametrize("case", ["skeleton-malformed", "skeleton-object-scalar", "header-offsets-overlap"])
def test_verify_refuses_a_structurally_bad_shard_whose_checksum_matches(tmp_path: Path, case: str) -> None:
    """Hostile corpus cases whose shard checksums were re-computed: only the structural checks
    (header bounds, skeleton) can refuse them, and a verified checkpoint must also load."""
    from hostile.corpus import build

    (c,) = build(tmp_path, [case])
    info = inspect_dir(2, c.step2, verify=True)
    assert not info.complete and info.verified is False, info
    assert c.message in (info.problem or "")
    from slurmresume.cli import app

    env = {"COLUMNS": "120", "TERM": "dumb", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""}
    r = CliRunner().invoke(app, ["verify", "2", "-d", str(c.root)], env=env)
    assert r.exit_code == 1, r.stdout

"""The failure-time save: when a rank of this node dies without warning (SIGKILL, an OOM kill), the
ranks still alive commit the last step boundary they hold, without any collective with the dead
(DESIGN.md section 10). Only under the node launcher, with every rank on this node (the
launcher's node-local heartbeat directory holds what is published). Replicated tensors on a GPU:
the NCCL communicator is aborted and they are copied on a side stream (train/failgpu.py).

At each `ckpt.step(s)` (`FailureGuard.at_step`, every rank, before the step's agreement):
  - the first call learns which tensors are replicated (the same MAX reductions a save uses,
    `checkpoint.replicas.replicated_across`: collective, once per run);
  - each rank publishes its small state at `s` to `<heartbeat dir>/failsave/snap-R-{s % 2}`
    (`train.stepsnap`: plain values, sampler, optimizer hyper-parameters, the RNG of every
    generator the save covers, metrics, and the tensors that are not replicated when they are
    small; one checked copy into the slot file). The last two steps stay. The training thread only takes what
    must be taken at that moment (`stepsnap.grab`: each entry's JSON text, copies of per-rank
    tensors, the RNG states); the record and the write are done by this rank's
    publisher (`train.snappub`: a list of sinks per slot), inline by default or on its own thread
    (`PUBLISH_IN_BACKGROUND`; coalescing there: when it falls behind, the newest capture of each
    slot wins);
  - the rank's "dirty" flag is cleared; torch.optim's global step pre-hook sets it, so a rank
    knows whether its tensors are still those of step `s`;
  - that pre-hook also publishes the rank's *tail* snapshot (`snap-R-tail`: its small state just
    before the optimizer step after `s`), and the next boundary records which pieces changed
    between the two (`tail_changed`, compared by their bytes, `stepsnap.moved`, over the whole run; a reader
    derives each piece's digest from the records, `stepsnap.digests`). A rank killed after the gradient
    all-reduce and before its next `ckpt.step()` is then still covered (`survivors.plan`).
    The comparison runs in the publisher, every tail against the boundary after it, in order,
    also for captures that coalescing does not write.

The window a publisher thread leaves: a rank killed in the few hundred microseconds between
a capture and its write landing leaves that slot one capture behind (a boundary slot holding the
step two before, a tail slot the tail before). Every record names its own step (and a tail its
boundary), so a lagging slot is read as what it is: `survivors.plan` finds that rank's boundary
missing and covers it by its tail only when the tail follows its newest boundary on disk, else it
refuses the step and the run falls back to the newest committed step; never a mixed step. A
survivor drains its publisher before it reports its status and publishes nothing after.

The death (`peers.Watcher`, a thread blocked on pidfds of this node's other ranks, no polling): a peer
that exits without having closed its Checkpointer. Then, on each survivor:
  1. freeze: no optimizer step may start any more (it blocks); a survivor already past its
     optimizer step finishes the step up to its `ckpt.step()`, which publishes that boundary and
     blocks (at most FINISH_WAIT_S: a survivor still dirty then holds nothing);
  2. wait until its own snapshots are on disk (its publisher drained, then stopped), publish its
     status (last boundary, clean or not) and wait for the other survivors'
     (at most STATUS_WAIT_S: a survivor that does not answer holds nothing);
  3. `survivors.plan` (pure): the newest step covered by every rank's snapshot and held clean by
     a survivor; its lowest such survivor writes every rank's shard (replicated tensors from its
     memory, per-rank state from the snapshots), then the manifest and the marker
     (`checkpoint.commit`: same checksums, same marker-last commit as any save); a shard with
     pieces too large to publish (FSDP2/HSDP) is written by a clean survivor holding them (the
     rank itself, or its HSDP replica peer) into the same directory, before the marker
     (`train.failwrite`); a dead FSDP2 rank's such pieces come from its own memory-tier snapshot of
     exactly that step, read and verified by its node's lowest survivor before it reports its
     status (`_offer`, train/memshard.py), which then writes that shard;
  4. a `failure_save` event says what committed, or why nothing did (the missing pieces), and the
     survivor leaves at once (`os._exit`), before torchrun's SIGKILL.
A second failure during the failure save (the writer dies): the save's private directory is
never committed (no marker); the launcher resumes from the newest committed step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..checkpoint.replicas import LIBRARY_PREFIX, replicated_across
from ..checkpoint.reports import SaveOutcome
from ..checkpoint.state import flatten
from ..contract import (
    ENV_FAILSAVE_SHARED,
    ENV_HEARTBEAT_DIR,
    ENV_RUN_ID,
    FAILSAVE_NOTICE,
    FAILSAVE_SUBDIR,
    read_json,
    write_json,
)
from ..events import EV_FAILURE_SAVE, EV_SAVE_COMMITTED, try_append_event
from . import ddp, memshard, rng, stepsnap
from .failwrite import Writer
from .peers import (
    Watcher,
    mark_done,
    peers,
    post_dead,
    posted_dead,
    publish_pid,
    read_status,
    write_status,
)
from .snapcopy import Copier
from .snappub import FileSink, Publisher
from .survivors import Plan, Snapshot, Status, plan

log = logging.getLogger("slurmresume")

SUBDIR = FAILSAVE_SUBDIR
SLOTS = ("0", "1", "tail")  # a rank's snapshot slots: boundaries by step % 2, and the tail
_BOUNDARY_SLOTS = SLOTS[:2]
STATUS_WAIT_S = 10.0  # how long a survivor waits for the others' status (torchrun kills after 30 s)
FINISH_WAIT_S = 5.0  # how long a survivor past its optimizer step may take to reach its ckpt.step()
PUBLISH_WAIT_S = 5.0  # how long a survivor waits for its own snapshots to reach the disk
# the snapshots' digests, encoding and write on a publisher thread (True) or inline at the capture:
# inline measured cheaper on a box whose cores the ranks fill (docs/benchmarks.md, 2026-12-07 16:xx)
PUBLISH_IN_BACKGROUND = False
EXIT_GRACE_S = 3.0  # a rank whose script raised (a collective broke) waits this long for the death
REMOTE_GRACE_S = 10.0  # the same with several nodes: another node's notice comes through its launcher
OFFER_WAIT_S = 2.0  # how long `_offer` waits for its own writer thread to learn the snapshot's directory
OFFER_PREFIX = "memshard-"  # + dead rank + ".json": a survivor's offer of its memory-tier shard (`_offer`)
EXIT_FAILED = 1  # a survivor's exit code after the failure save (torchrun reports the run failed)


class FailureGuard:
    """One per Checkpointer, every rank. See the module docstring for the protocol."""

    def __init__(self, directory: Path, root: Path, rank: int, world: int, *, local: range | None = None,
                 shared: Path | None = None) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.dir, self.root, self.rank, self.world = directory, root, rank, world
        self.local = local if local is not None else range(world)  # this node's ranks
        self.shared = shared  # several nodes: where the survivors of every node meet (job/deathboard.py)
        self.meet = shared if shared is not None else directory
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._frozen = threading.Event()
        self._reported = threading.Event()  # this rank's status is out: nothing more is published
        self._boundary: int | None = None
        self._dirty = False
        self._state: Mapping[str, Any] | None = None
        self._layout: stepsnap.Layout | None = None
        # the background publisher (train/snappub.py): a list of sinks per slot
        self._pub = Publisher({slot: [FileSink(self.dir / f"snap-{rank}-{slot}")] for slot in SLOTS},
                              background=PUBLISH_IN_BACKGROUND)
        self._rng = rng.Capturer()
        self._meta: Any = None
        self._last_ddp: dict[str, str] | None = None
        self._group: Any = None
        # the publisher thread's own (see _prepare_boundary): the last tail capture's pieces, the
        # pieces ever changed between a tail and its boundary, and the state keys among them
        self._tail: stepsnap.Grab | None = None
        self._tail_changed: set[str] = set()
        self._tail_sorted: list[str] = []  # the same, sorted (as each boundary's record lists it)
        self._known: frozenset[str] = frozenset()  # read by the training thread (replaced, never changed)
        self._ddp_layout: dict[str, str] | None = None
        self._failing: threading.Thread | None = None
        self._copier: Copier | None = None  # several nodes: each snapshot also on the shared root
        self._watcher: Watcher | None = None
        # the memory tier (train/memtier.py), when the run has one: set by the Checkpointer
        self.memory: Any = None
        self._unpublished = False  # this rank's boundary names pieces it could not publish (`at_step`)
        self._snapshot_pieces: dict[int, dict[str, Any]] = {}  # dead rank -> its verified memory-tier tensors
        self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        publish_pid(self.dir, rank)

    # -- the training thread --------------------------------------------------------------

    def at_step(self, step: int, state: Mapping[str, Any], metrics: Any, meta: Any, group: Any,
                ddp_buckets: Mapping[str, Any]) -> None:
        """Every rank, at the start of `ckpt.step(step)`: (once) the replicated set, then this
        rank's snapshot of `step`. Blocks for good once a peer died (the process exits from the
        failure-save thread)."""
        if self._reported.is_set() or (self._frozen.is_set() and self._layout is None):
            self._block()
        if self._layout is None:  # collective, once: every rank's first step()
            layout = ddp.capture(ddp_buckets) if ddp_buckets else {}
            skeleton, tensors = flatten(state, {"rng": rng.capture(), "ddp": layout} if layout else
                                        {"rng": rng.capture()})
            # the library's own per-rank state (RNG) is always published, never taken from memory
            replicated = {n for n in replicated_across(group, tensors, skeleton.get("dtensors"))
                          if not n.startswith(LIBRARY_PREFIX)}
            self._layout = stepsnap.Layout.learn(state, replicated, self.world)
            self._check_shared(group)
        # (the layouts, once DDP rebuilt its buckets, are kept: no call for them then)
        self._last_ddp = self._ddp_layout if self._ddp_layout is not None else self._ddp_layouts(ddp_buckets)
        g = stepsnap.grab(step, state, self._layout, self._last_ddp, metrics, meta, rng_state=self._rng.raw())
        with self._lock:
            # frozen but not yet reported: this survivor finishes the step it was in (see on_death)
            if not self._reported.is_set():
                self._pub.submit(_BOUNDARY_SLOTS[step % 2], lambda: self._prepare_boundary(g))
                self._boundary, self._dirty, self._state, self._meta = step, False, state, meta
                self._unpublished = bool(g.missing)  # pieces only a memory snapshot can give (train/memshard.py)
                self._group = group
        if self._frozen.is_set():
            self._block()
        if self._watcher is None:
            self._watch()

    def _check_shared(self, group: Any) -> None:
        """Several nodes, collective, once: every rank got the same shared directory and sees rank
        0's file in it (the root really is shared). Otherwise the survivors of a node meet only
        among themselves, and a death elsewhere goes unsaved (never a wrong save: a rank that
        does not answer holds nothing)."""
        if self.world == len(self.local):
            return
        token = f"hello-{os.environ.get(ENV_RUN_ID, '')}-{os.getpid()}" if self.rank == 0 else ""
        if token and self.shared is not None:
            write_json(self.shared / token, {"rank": 0})
        paths = group.all_gather_json([str(self.shared), token])
        ok = self.shared is not None and len({p for p, _ in paths}) == 1 and (self.shared / paths[0][1]).is_file()
        if group.max_int(0 if ok else 1):
            log.warning("rank %d: no failure save across nodes (the run's shared directory %s is not the "
                        "same on every node)", self.rank, self.shared)
            self.shared, self.meet = None, self.dir
        elif self.shared is not None:  # before the first snapshot is submitted: a second sink per slot
            self._copier = Copier(self.shared, self.rank)
            for slot in SLOTS:
                self._pub.sinks[slot].append(self._copier.sink(slot))

    def _ddp_layouts(self, ddp_buckets: Mapping[str, Any]) -> dict[str, str]:
        """The DDP bucket layouts while they are not kept yet (`at_step` takes `_ddp_layout` once
        it is), without a collective: DDP rebuilds once (at the first step's capture, above), so a
        complete layout is kept for good."""
        if not ddp_buckets or ddp.rebuild_pending(ddp_buckets):
            return {}
        layout = ddp.capture(ddp_buckets)
        if all(layout.values()):
            self._ddp_layout = layout
        return layout

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch.optim's global pre-hook, before any optimizer step: the first one after a
        boundary publishes this rank's tail snapshot, then marks the rank dirty. With a memory tier,
        the first one after a boundary first waits for that boundary's memory snapshot to end
        (`MemoryTier.wait_ended`): a survivor past this point then knows every rank's shard of it
        landed, so a death costs at most one step (train/memshard.py). Only a rank with pieces its
        small snapshot cannot carry (FSDP2's shards) waits: whatever else dies is covered by the
        survivors and the snapshots (DDP never waits for the memory tier here)."""
        if self.memory is not None and self._unpublished and not self._dirty and self._boundary is not None:
            self.memory.wait_ended(self._boundary, self._frozen.is_set)
        if self._frozen.is_set():
            self._block()
        if not self._dirty and self._layout is not None and self._state is not None and self._boundary is not None:
            boundary = self._boundary
            g: stepsnap.Grab | None = stepsnap.grab(boundary, self._state, self._layout, self._last_ddp, None,
                                                    self._meta, skip=self._known, rng_state=self._rng.raw())
        else:
            g = None
        with self._lock:
            frozen = self._frozen.is_set()
            if not frozen:
                if g is not None:
                    tail = g
                    self._pub.submit("tail", lambda: self._prepare_tail(tail, boundary))
                self._dirty = True
        if frozen:
            self._block()

    # -- the publisher thread (train/snappub.py: in submission order) -------------------------

    def _prepare_boundary(self, g: stepsnap.Grab) -> Callable[[], list[bytes]]:
        """The pieces that changed since the tail before this boundary (compared by their bytes)."""
        if self._tail is not None:
            moved = stepsnap.moved(self._tail, g)
            self._tail = None
            if not moved <= self._tail_changed:  # (then the sorted list and the keys again)
                self._tail_changed |= moved
                self._tail_sorted = sorted(self._tail_changed)
                self._known = frozenset(p[6:] for p in self._tail_changed if p.startswith("entry:"))
        tail_changed = self._tail_sorted  # replaced when it grows, never changed in place
        return lambda: stepsnap.record(g, tail_changed=tail_changed)

    def _prepare_tail(self, g: stepsnap.Grab, boundary: int) -> Callable[[], list[bytes]]:
        self._tail = g
        return lambda: stepsnap.record(g, tail_of=boundary)

    def _block(self) -> None:
        threading.Event().wait()  # the failure-save thread ends the process

    def _watch(self) -> None:
        if self._watcher is None:
            fds = peers(self.dir, self.local, self.rank)
            if fds is not None:
                self._watcher = Watcher(self.dir, fds, self.on_death, *self._notice())
                self._watcher.start()

    def _notice(self) -> tuple[int | None, Callable[[], set[int]]]:
        """Several nodes: the launcher's FIFO (readable once a node posted a death) and how to read
        the posted dead. One node: none."""
        if self.shared is None:
            return None, set
        try:
            fd = os.open(self.dir / FAILSAVE_NOTICE, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("rank %d: deaths on other nodes go unseen (%s)", self.rank, exc)
            return None, set
        shared = self.shared
        return fd, lambda: posted_dead(shared)

    def _dead_now(self) -> set[int]:
        local = self._watcher.dead_now() if self._watcher is not None else set()
        return local | (posted_dead(self.shared) if self.shared is not None else set())

    def close(self) -> None:
        """Every rank, at `Checkpointer.close()`: this rank ends normally (its peers must not take
        its exit for a death); stop watching."""
        mark_done(self.dir, self.rank)
        self._hook.remove()
        if self._copier is not None:
            self._copier.stop()
        if self._watcher is not None:
            self._watcher.stop()
        self._pub.close()

    def at_exit(self) -> None:
        """atexit, before anything else is released. A normal exit (the script forgot close()) is
        marked done, so its peers do not take it for a death; a script that died of an exception
        (a collective broke because a peer died) waits for the failure save, which exits; any other
        exception is this rank's own failure, which its peers save for."""
        if getattr(sys, "last_value", None) is None:  # a normal exit without close(): no death either
            mark_done(self.dir, self.rank)
            return
        if self._watcher is None:
            return
        deadline = time.monotonic() + (REMOTE_GRACE_S if self.shared is not None else EXIT_GRACE_S)
        while self._failing is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._failing is not None:
            self._failing.join()

    # -- the failure-save thread ----------------------------------------------------------

    def on_death(self, dead: set[int]) -> None:
        """On the watcher thread: freeze, agree by files, write if chosen, exit."""
        self._failing = threading.current_thread()
        began = time.time()
        try:
            if self.shared is not None:  # first: the other nodes' ranks learn of it from this
                post_dead(self.shared, dead & set(self.local), self.rank)
            self._frozen.set()
            me = self._finish_step()
            self._offer(dead, me)  # before this survivor's status: whoever reads the status reads the offer
            if self.shared is not None:
                if self._copier is not None:
                    self._copier.drain()  # then the copy below is the newest
                self._copy_out(dead)
            write_status(self.meet, me)
            statuses, dead = self._gather(dead)
            snaps = {r: _snapshots(self.meet, r) for r in range(self.world)}
            p = plan(self.world, dead, statuses, snaps, replicated_known=self._layout is not None,
                     replicas=self._layout.replicas if self._layout is not None else None,
                     memory=_offers(self.meet, dead, statuses))
            self._act(p, dead, began)
        except Exception as exc:  # noqa: BLE001 - never leave a frozen rank behind
            log.warning("rank %d: failure save failed: %s", self.rank, exc)
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_FAILED)

    def _finish_step(self) -> Status:
        """This survivor's status, once it stands still: clean at its last boundary, or dirty (an
        optimizer step ran and the training thread did not reach its `ckpt.step()` within
        FINISH_WAIT_S: a collective after the optimizer step, a very slow step)."""
        deadline = time.monotonic() + FINISH_WAIT_S
        while True:
            with self._lock:
                if not self._dirty or time.monotonic() > deadline:
                    self._reported.set()  # from here on nothing is submitted
                    status = Status(self.rank, self._boundary, not self._dirty)
                    break
            time.sleep(0.01)
        # what this status stands on (its boundary's snapshot, the tail after it) is on disk first
        if not self._pub.drain(PUBLISH_WAIT_S):
            log.warning("rank %d: its snapshots did not reach the disk (%s)", self.rank,
                        self._pub.failed or f"not within {PUBLISH_WAIT_S} s")
        self._pub.stop()  # a reported rank publishes nothing more
        return status

    def _offer(self, dead: set[int], me: Status) -> None:
        """This node's lowest survivor, clean at its boundary `s`, when ranks of this node died: each
        one's shard of `s` from the node's memory tier, read and verified (train/memshard.py), kept
        for the writer and offered to the plan by a file every survivor reads (`memshard-R.json`).
        Anything less: one warning naming why, and no offer (the plan refuses as without it)."""
        mine = sorted(dead & set(self.local))
        if (self.memory is None or not mine or not me.clean or me.boundary is None
                or self.rank != min(r for r in self.local if r not in dead)):
            return
        kept = self.memory.record(me.boundary, OFFER_WAIT_S)
        for r in mine:
            try:
                self._snapshot_pieces[r] = memshard.pieces(self.memory.root, me.boundary, kept, r, self.world)
            except memshard.Refused as exc:
                log.warning("rank %d: rank %d's memory snapshot of step %d not used: %s", self.rank, r, me.boundary,
                            exc)
                continue
            write_json(self.meet / f"{OFFER_PREFIX}{r}.json", {"rank": r, "step": me.boundary, "holder": self.rank,
                                                               "run_id": os.environ.get(ENV_RUN_ID)})

    def _copy_out(self, dead: set[int]) -> None:
        """Several nodes: this rank's snapshots, and those of this node's dead ranks (by the lowest
        survivor of the node), copied from the node-local directory to where every node reads
        them (`stepsnap.read` checks each copy as it checks the original)."""
        ranks = [self.rank]
        if self.rank == min(r for r in self.local if r not in dead):
            ranks += sorted(dead & set(self.local))
        for r in ranks:
            for slot in SLOTS:
                try:
                    data = stepsnap.cut((self.dir / f"snap-{r}-{slot}").read_bytes())  # not the slot's zeros
                except OSError:
                    continue
                tmp = self.meet / f"snap-{r}-{slot}.{os.getpid()}.out.tmp"
                tmp.write_bytes(data)
                os.replace(tmp, self.meet / f"snap-{r}-{slot}")

    def _gather(self, dead: set[int]) -> tuple[dict[int, Status], set[int]]:
        deadline = time.monotonic() + STATUS_WAIT_S
        while True:
            dead = dead | self._dead_now()
            statuses = {r: s for r in range(self.world) if r not in dead
                        if (s := read_status(self.meet, r)) is not None}
            if len(statuses) + len(dead) >= self.world or time.monotonic() > deadline:
                return statuses, dead
            time.sleep(0.02)

    def _writer(self) -> Writer:
        return Writer(self.meet, self.root, self.rank, self.world, self._state, self._layout, self._boundary,
                      not self._dirty, self._dead_now,
                      getattr(self._group, "pg", None), self._snapshot_pieces)

    def _act(self, p: Plan, dead: set[int], began: float) -> None:
        survivors = [r for r in range(self.world) if r not in dead]
        if p.ok and p.writer == self.rank:
            assert p.step is not None
            try:
                outcome = self._writer().commit(p)  # None: committed already
            except Exception as exc:  # noqa: BLE001 - a failure save that fails is reported, never raised
                outcome = SaveOutcome(False, error=f"{type(exc).__name__}: {exc}")
            seconds = round(time.time() - began, 3)
            if outcome is None:  # a periodic save of the same step won the race: nothing to add
                log.warning("rank(s) %s died: step %d is committed already", sorted(dead), p.step)
            elif outcome.ok:
                log.warning("rank(s) %s died: failure save of step %d committed by rank %d in %.2f s",
                            sorted(dead), p.step, self.rank, seconds)
                try_append_event(self.root, EV_SAVE_COMMITTED, step=p.step, seconds=seconds, reason="failure",
                                 world_size=self.world, run_id=os.environ.get(ENV_RUN_ID))
            else:
                log.warning("failure save of step %d not committed: %s", p.step, outcome.error)
            try_append_event(self.root, EV_FAILURE_SAVE, step=p.step, committed=outcome is None or outcome.ok,
                             already=True if outcome is None else None, dead=sorted(dead), writer=self.rank,
                             writers={str(r): w for r, w in p.shards} or None,
                             from_snapshot=list(p.from_snapshot) or None,
                             seconds=seconds, error=(outcome.error or None) if outcome is not None else None,
                             run_id=os.environ.get(ENV_RUN_ID))
        elif p.ok and any(w == self.rank for _, w in p.shards):  # holds pieces the committer lacks
            why = self._writer().help(p)
            if why is not None:
                log.warning("rank %d: wrote no shard of the failure save of step %s: %s", self.rank, p.step, why)
        elif not p.ok and survivors and self.rank == survivors[0]:
            log.warning("ranks %s died: no failure save (missing: %s); resuming from the newest committed step",
                        sorted(dead), "; ".join(p.refused))
            try_append_event(self.root, EV_FAILURE_SAVE, step=None, committed=False, dead=sorted(dead),
                             missing=list(p.refused), run_id=os.environ.get(ENV_RUN_ID))


def failure_guard(group: Any, root: Path) -> FailureGuard | None:
    """The guard when this rank runs under the launcher: its whole world on this node, or several
    nodes whose launchers gave the run a shared directory (job/deathboard.py). Else None (a bare
    run, one rank)."""
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    world = group.world_size
    local = _local_ranks(group.rank, world)
    shared = os.environ.get(ENV_FAILSAVE_SHARED) if local is not None and len(local) < world else None
    if not directory or world < 2 or local is None or not os.path.isdir(directory) \
            or (len(local) < world and not (shared and os.path.isdir(shared))):
        return None
    try:
        return FailureGuard(Path(directory) / SUBDIR, root, group.rank, world, local=local,
                            shared=Path(shared) if shared else None)
    except OSError as exc:
        log.warning("no failure save on rank %d: %s", group.rank, exc)
        return None


def _local_ranks(rank: int, world: int) -> range | None:
    """This node's ranks: torchrun numbers a node's LOCAL_WORLD_SIZE ranks contiguously (same
    count on every node). None when the environment does not say."""
    try:
        size, local_rank = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except (KeyError, ValueError):
        return None
    first = rank - local_rank
    if size < 1 or world % size or not 0 <= local_rank < size or first % size:
        return None
    return range(first, first + size)


def _offers(directory: Path, dead: set[int], statuses: Mapping[int, Status]) -> dict[int, tuple[int, int]]:
    """Dead rank -> (step, survivor) of each memory-tier offer of this run (`FailureGuard._offer`)
    whose survivor reported (its offer was written before its status)."""
    out = {}
    for r in sorted(dead):
        got = read_json(directory / f"{OFFER_PREFIX}{r}.json")
        if (isinstance(got, dict) and got.get("rank") == r and got.get("run_id") == os.environ.get(ENV_RUN_ID)
                and type(got.get("step")) is int and got.get("holder") in statuses):
            out[r] = (got["step"], got["holder"])
    return out


def _snapshots(directory: Path, rank: int) -> list[Snapshot]:
    out = []
    for slot in SLOTS:
        snap = stepsnap.read(directory / f"snap-{rank}-{slot}")
        if snap is not None:
            try:
                pieces = stepsnap.digests(snap)
            except (KeyError, TypeError, ValueError, IndexError):  # checksummed, yet not what this version writes
                continue
            out.append(Snapshot(rank, snap["step"], tuple(snap.get("missing") or ()), snap.get("tail_of"),
                                pieces, frozenset(snap.get("tail_changed") or ())))
    return out

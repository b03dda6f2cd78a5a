"""The memory tier, on the ranks: a snapshot of the state every `snapshot_every` steps into the
node's memory root ($SLURMRESUME_MEMORY_DIR, tmpfs, made and freed by the node launcher:
job/memroot.py), in the file tier's format, so a restart inside the allocation restores from it
first (train/memrestore.py) with the same checks as from a file checkpoint.

A snapshot is a save like any other: `saving.save_collective` on the memory root (per-rank
safetensors, their digests, the manifest, COMMITTED last), started by the one background writer
(`asyncsave.AsyncWriter`: the tensors copied into its reused buffers, written on its thread), so
training pays the copy, not the write. On one node at most two snapshots exist: the newest
committed one and the one being written (rank 0 removes the older ones once a snapshot commits).
With a peer copy (several nodes) each node also keeps the two steps the ranks pinned for it
(peerpin.py: the one being copied, the newest every successor acked), so at most four,
three while the copy keeps up; the fit check reads the free bytes, so it counts them as held. A
failed snapshot is a warning; training goes on with the file tier.

Who decides what, so that every rank makes the same collective calls at the same step:
  - when: step numbers only (`memplan.Schedule`, pure). `snapshot_every=N`: every step divisible by N.
    "auto": the first snapshot after MEASURE_STEPS calls of `step()`, the second MEASURE_STEPS
    later, then every N steps, N the largest interval any rank proposes (`memplan.auto_interval`: its
    measured cost, the copy it waited for plus what the background write added to the steps it
    overlapped, over BUDGET of its median step), agreed at each snapshot, printed once.
  - whether it fits: each rank checks the node's tmpfs and MemAvailable (`memplan.refusal`) for
    its node's share with headroom; the MAX over ranks is the verdict. A refusal is one warning,
    and the tier is off for the rest of this process: never an OOM kill of the training.

Several nodes (`spread`): each node's memory root is its own directory on its own tmpfs, and
every rank writes its shard into its node's root, with every tensor it holds (no replica is left
to rank 0's shard, `save_collective(dedup=False)`: a rank's restore then opens its own shard only,
on its own node; the fit check above already counts every rank's whole state). Rank 0 commits the
step in its node's root as in any save; then one broadcast sends its manifest and marker to every
node's first rank (LOCAL_RANK 0), which writes them into its node's copy of the save directory
and publishes it as the step (`finish_node`): each node's root then holds a committed step of
that step's manifest with its own ranks' shards. A node whose copy did not finish simply lacks
the step; the restore takes only a step every node holds with the same marker (memrestore.py).
Each node's first rank frees its node's older snapshots.

What the failure save reads of it (train/memshard.py): each rank records the private directory of
each snapshot (`kept`, the name rank 0 broadcast, unique to that save) and whether the snapshot
committed. A snapshot of step s is written while step s+1 runs; a rank's optimizer step of s+1
waits until its snapshot of s has ended (`wait_ended`, from the failure guard's optimizer pre-hook),
so that a survivor past its optimizer step of s+1 knows every rank's shard of s landed. That wait is
the price of "a killed rank costs <= 1 step": usually nothing (the write of s ends during the
forward and backward of s+1), the rest of the write when it does not.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import peerpin
from ..checkpoint.fsio import free_space
from ..checkpoint.layout import (
    MANIFEST,
    MARKER,
    parse_saving_dir,
    saving_dirs,
    step_dir_name,
    step_dirs,
)
from ..checkpoint.store import remove_private_step
from ..contract import ENV_MEMORY_DIR, ENV_MEMORY_LIMIT, ENV_SNAPSHOT_EVERY
from ..errors import ConfigError, SaveError
from ..events import EV_MEMORY_REFUSED, try_append_event
from .memplan import BUDGET, Cost, Schedule, refusal, setting
from .memshard import Kept

if TYPE_CHECKING:
    from ..checkpoint.collective import Group
    from .asyncsave import AsyncWriter
    from .saving import Payload

log = logging.getLogger("slurmresume")

BROKEN_GRACE_S = 10.0  # a snapshot that raised: how long the next optimizer step waits for a death's notice


class MemoryTier:
    """One Checkpointer's memory tier (None without $SLURMRESUME_MEMORY_DIR or when off)."""

    def __init__(self, root: Path, every: int | None, group: Group, writer: AsyncWriter, file_root: Path,
                 limit: int | None = None) -> None:
        self.root, self.group, self.writer, self.file_root, self.limit = root, group, writer, file_root, limit
        self.schedule = Schedule(every)
        self.cost = Cost()
        self.off = False  # refused once: the file tier alone from then on
        self.pending: float | None = None  # the blocking seconds of the snapshot last started
        self.printed = False
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        self.leader = node_leader()  # this node's first rank: frees its node's older snapshots
        self.spread = local < group.world_size  # several nodes: a root per node (see the module docstring)
        # the failure save's view (train/memshard.py): step -> this rank's record of its snapshot
        self.kept: dict[int, Kept] = {}
        self._started: int | None = None  # the step of the snapshot last started ...
        self._ended: int | None = None  # ... and of the last one whose save returned (or failed)
        self._broken = False  # ... which raised (a collective broke: a peer likely died)
        self._cv = threading.Condition()
        # several nodes with a peer copy: the snapshots kept for it (peerpin.py); None: none
        self.pins: peerpin.Pins | None = peerpin.Pins() if self.spread and peerpin.peer_copy_on() else None
        self._pins_agreed = False  # False: the next agreement starts from the node's pin file

    @classmethod
    def from_env(cls, value: Any, group: Group, writer: AsyncWriter, file_root: Path) -> MemoryTier | None:
        """Every rank: `value` is Checkpointer(snapshot_every=...), None: $SLURMRESUME_SNAPSHOT_EVERY,
        else auto. No memory root from the launcher: None (a bare run has no memory tier)."""
        directory = os.environ.get(ENV_MEMORY_DIR, "").strip()
        every = setting(value if value is not None else os.environ.get(ENV_SNAPSHOT_EVERY) or "auto")
        limit = _limit()
        if not directory or every == 0:
            return None
        return cls(Path(directory), every, group, writer, file_root, limit)

    def at_step(self, step: int, prepare: Any) -> None:
        """Every rank, at the end of `Checkpointer.step`: a snapshot of `step` when one is due (after
        the save in flight, if any: file tier or memory). `prepare()` returns this rank's Payload."""
        busy = self.writer.in_flight()
        self.cost.tick(busy)
        if self.pending is not None and not busy:
            self.cost.finished(self.pending)
            self.pending = None
        if self.off or not self.schedule.due(step):
            return
        # a save in flight is waited for (its wait counts in the cost): whether one is in flight
        # differs between ranks, and every rank must make the same collective calls
        began = time.perf_counter()
        try:
            started = self.writer.save(step, "wait", lambda: self._checked(step, prepare()),
                                       lambda snap, _s, blocking: self._write(step, snap, blocking), file_tier=False)
        except _Refused:
            return
        if started:
            with self._cv:
                self._started = step
            self.pending = self.writer.last_blocking_s
            self.cost.blocked = time.perf_counter() - began

    def _checked(self, step: int, payload: Payload) -> Payload:
        """Training thread, nothing in flight: the collective fit check and the interval agreement."""
        mine = sum(t.numel() * t.element_size() for _, t in payload.tensors)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        pool_new = 0 if self.writer.pool.nbytes else mine  # the writer's buffers, made by the first snapshot
        why = refusal(mine * local, _shm_free(self.root), *_meminfo(), self.limit, buffers=pool_new * local)
        pinned = self._pin_votes()
        refused, agreed, *votes = self.group.max_ints([int(why is not None), self.cost.proposal(), *pinned])
        if refused:
            self.off = True
            if self.group.rank == 0:
                why = why or "on another rank's node"
                log.warning("memory tier off for this run: a snapshot of step %d would not fit in this node's memory "
                            "(%s); training continues with the file tier", step, why)
                try_append_event(self.file_root, EV_MEMORY_REFUSED, step=step, reason=why)
            raise _Refused
        if self.pins is not None:
            self._pin(step, votes)
        if self.schedule.every is None:
            self.schedule.taken(agreed)
            if agreed and not self.printed and self.group.rank == 0:
                self.printed = True
                log.info("memory tier: a snapshot every %d step(s) (auto: the measured cost kept under %g%% of "
                         "the step time)", agreed, BUDGET * 100)
        return payload

    def _pin_votes(self) -> list[int]:
        """This rank's part of the peer copy's agreement (peerpin.py), [] without a peer
        copy: the pins it holds (after a restart: its node's pin file, kept only where every rank
        read the same), its node's ack, and whether its node lost the target or `keep`."""
        if self.pins is None:
            return []
        pins = self.pins if self._pins_agreed else peerpin.read_pins(self.root)
        acked, refused = peerpin.read_acked(self.root)
        t, k = peerpin.encode(pins.target), peerpin.encode(pins.keep)
        return [t, -t, k, -k, -peerpin.encode(acked),
                int(pins.target is not None and not peerpin.committed_here(self.root, pins.target)),
                int(pins.keep is not None and not peerpin.committed_here(self.root, pins.keep)),
                int(pins.target is not None and refused == pins.target)]

    def _pin(self, step: int, votes: list[int]) -> None:
        """Training thread, after the agreement: the pins of this snapshot, the same on every rank;
        each node's first rank writes them to its node's pin file, for its launcher's peer copy."""
        t_max, t_min, k_max, k_min, acked, lost, keep_lost, refused = votes
        same = t_max == -t_min and k_max == -k_min
        pins = peerpin.Pins(peerpin.decode(t_max), peerpin.decode(k_max)) if same else peerpin.Pins()
        self._pins_agreed = True
        self.pins = peerpin.advance(pins, peerpin.decode(-acked), bool(lost), bool(refused), step, bool(keep_lost))
        if self.leader:
            try:
                peerpin.write_pins(self.root, self.pins)
            except OSError as exc:
                log.warning("memory tier: the peer copy's pin file could not be written (%s)", exc)

    def _write(self, step: int, snapshot: Payload, blocking_s: float) -> None:
        """Writer thread, every rank: the collective save into the memory root (several nodes: then
        each node's copy finished, `_finish_nodes`); a failure is a warning (rank 0), never an
        error for training. Each node's first rank then frees its node's older snapshots."""
        broken = True
        try:
            self._save(step, snapshot, blocking_s)
            broken = False
        finally:
            with self._cv:
                self._ended, self._broken = step, broken
                self._cv.notify_all()

    def _save(self, step: int, snapshot: Payload, blocking_s: float) -> None:
        from .saving import save_collective

        try:
            result = save_collective(self.group, self.root, step, snapshot, replace_if_changed=False, emergency=True,
                                     dedup=not self.spread, on_prepared=lambda into: self._prepared(step, into))
        except (SaveError, OSError) as exc:
            if self.group.rank == 0:
                log.warning("memory snapshot of step %d failed: %s", step, exc)
            return
        if result.outcome is not None and not result.outcome.ok:  # the same outcome on every rank
            if self.group.rank == 0:
                log.warning("memory snapshot of step %d failed: %s", step, result.outcome.error)
            return
        if self.spread and not result.skipped and not self._finish_nodes(step, result.into or ""):
            return
        if not self.spread:  # rank 0's commit renamed this save's own directory to step_N
            self._committed(step, None)
        if self.group.rank == 0 and not result.skipped:
            log.debug("memory snapshot of step %d: %d bytes, copy %.3f s", step, result.bytes, blocking_s)
        if self.leader:
            prune(self.root, step, self.pins.held() if self.pins is not None else set())

    def _finish_nodes(self, step: int, into: str) -> bool:
        """Collective, several nodes, once rank 0 committed `step` in its node's root: its manifest
        and marker to every rank (one broadcast), and each other node's first rank publishes its
        node's copy (`finish_node`). Returns whether this node holds the step now."""
        packed = b""
        if self.group.rank == 0:
            d = self.root / step_dir_name(step)
            try:
                manifest = (d / MANIFEST).read_bytes()
                packed = len(manifest).to_bytes(8, "big") + manifest + (d / MARKER).read_bytes()
            except OSError as exc:
                log.warning("memory snapshot of step %d: its manifest could not be read back (%s)", step, exc)
        got = self.group.broadcast_bytes(packed)
        parts = unpack(got)
        if parts is not None:  # this node's step_N is this save's only with this marker (memshard.locate)
            self._committed(step, parts[1])
        if not self.leader or self.group.rank == 0:
            return True  # rank 0's node: committed by the save itself
        problem = finish_node(self.root, step, into, got)
        if problem is not None:
            log.warning("memory snapshot of step %d not kept on this node (rank %d's): %s", step, self.group.rank,
                        problem)
        return problem is None

    def _prepared(self, step: int, into: str) -> None:
        """Writer thread, every rank, once rank 0's private directory of `step` is known: recorded
        (the last two steps only)."""
        with self._cv:
            self.kept = {s: k for s, k in self.kept.items() if s >= step - 1}
            self.kept[step] = Kept(into)
            self._cv.notify_all()

    def _committed(self, step: int, marker: bytes | None) -> None:
        with self._cv:
            if step in self.kept:
                self.kept[step] = Kept(self.kept[step].into, committed=True, marker=marker)

    def wait_ended(self, step: int, stop: Any) -> None:
        """Training thread, before its optimizer step after `ckpt.step(step)`: wait until the
        snapshot of `step`, if one was started, has ended (see the module docstring). `stop()`
        true: return at once (a peer died: the failure guard blocks the caller for good)."""
        with self._cv:
            while self._started == step and (self._ended is None or self._ended < step) and not stop():
                self._cv.wait(0.05)
            # a snapshot whose collective broke: a peer likely died, and a survivor that took its
            # optimizer step now would hold no boundary; the failure guard's freeze comes first
            deadline = time.monotonic() + BROKEN_GRACE_S
            while self._ended == step and self._broken and not stop() and time.monotonic() < deadline:
                self._cv.wait(0.05)

    def record(self, step: int, wait_s: float = 0.0) -> Kept | None:
        """The failure save's thread: this rank's record of its snapshot of `step`, or None. A
        snapshot of `step` started whose directory is not known yet (this rank's writer thread one
        collective behind a rank that died) is waited for up to `wait_s`."""
        deadline = time.monotonic() + wait_s
        with self._cv:
            while step not in self.kept and self._started == step and (left := deadline - time.monotonic()) > 0:
                self._cv.wait(min(left, 0.05))
            return self.kept.get(step)

    def forget_from(self, step: int) -> None:
        """Rank 0, after an explicit save of `step` replaced what the file tier held: the memory
        snapshots of `step` and later no longer hold what the run saved last."""
        forget_from(self.root, step)


class _Refused(Exception):
    pass


def node_leader() -> bool:
    """This rank is its node's first (LOCAL_RANK 0; a bare process is its own node's)."""
    return (os.environ.get("LOCAL_RANK", "0") or "0") == "0"


def unpack(packed: bytes) -> tuple[bytes, bytes] | None:
    """Rank 0's manifest and marker from the broadcast `_finish_nodes` makes (8-byte length, the
    manifest, the marker); None when they did not arrive whole."""
    size = int.from_bytes(packed[:8], "big")
    manifest, marker = packed[8:8 + size], packed[8 + size:]
    return (manifest, marker) if len(packed) >= 8 and len(manifest) == size and marker else None


def finish_node(root: Path, step: int, into: str, packed: bytes) -> str | None:
    """A node's first rank, several nodes: its node's copy of the save directory `into` (its ranks'
    shards, written by the save) gets rank 0's manifest and marker (`packed`: 8-byte length, the
    manifest, the marker), marker last, and is published as the step (a previous copy of that
    step replaced: this job's own tmpfs). Returns why not, or None."""
    if len(packed) < 8:
        return "rank 0 sent no manifest"
    parts = unpack(packed)
    if parts is None:
        return "rank 0's manifest and marker arrived cut"
    manifest, marker = parts
    if parse_saving_dir(into) != step:
        return f"{into!r} is not a save directory of step {step}"
    mine = root / into
    if not mine.is_dir():
        return f"{mine} is missing (no rank of this node wrote its shard)"
    try:
        (mine / MANIFEST).write_bytes(manifest)
        (mine / MARKER).write_bytes(marker)
        target = root / step_dir_name(step)
        if os.path.lexists(target):
            remove_private_step(target)
        os.rename(mine, target)
    except OSError as exc:
        remove_private_step(mine)
        return f"{type(exc).__name__}: {exc}"
    return None


def forget_from(root: Path, step: int) -> None:
    """Rank 0: every memory snapshot of `step` or later, gone (they are of another trajectory than
    the one the run now holds). Never raises."""
    for s, path in step_dirs(root):
        if s >= step:
            remove_private_step(path)


def prune(root: Path, newest: int, pinned: set[int] | frozenset[int] = frozenset()) -> None:
    """A node's first rank, once `newest` committed in the memory root (this job's alone, on this
    node): every older step, committed or left by a killed writer, is removed (marker first),
    but the committed steps the peer copy pins (peerpin.py). Never raises."""
    for s, path in step_dirs(root):
        if s < newest and s not in pinned:
            remove_private_step(path)
    for s, path in saving_dirs(root):
        if s < newest:
            remove_private_step(path)


def _shm_free(path: Path) -> int | None:
    free = free_space(path)[0]
    return free if free >= 0 else None


def _meminfo() -> tuple[int | None, int | None]:
    """(MemAvailable, MemTotal) in bytes, None where /proc/meminfo does not say."""
    found: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key in ("MemAvailable", "MemTotal"):
                    found[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return found.get("MemAvailable"), found.get("MemTotal")


def _limit() -> int | None:
    raw = os.environ.get(ENV_MEMORY_LIMIT, "").strip()
    if not raw:
        return None
    try:
        return max(0, int(raw))
    except ValueError:
        raise ConfigError(f"{ENV_MEMORY_LIMIT}={raw!r} is not a number of bytes") from None

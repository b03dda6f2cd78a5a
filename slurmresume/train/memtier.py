"""The memory tier, on the ranks: a snapshot of the state every `snapshot_every` steps into the
node's memory root ($SLURMRESUME_MEMORY_DIR, tmpfs, made and freed by the node launcher:
job/memroot.py), in the file tier's format, so a restart inside the allocation restores from it
first (train/memrestore.py) with the same checks as from a file checkpoint.

A snapshot is a save like any other: `saving.save_collective` on the memory root (per-rank
safetensors, their digests, the manifest, COMMITTED last), started by the one background writer
(`asyncsave.AsyncWriter`: the tensors copied into its reused buffers, written on its thread), so
training pays the copy, not the write. At most two snapshots exist: the newest committed one and
the one being written (rank 0 removes the older ones once a snapshot commits). A failed snapshot
is a warning; training goes on with the file tier.

Who decides what, so that every rank makes the same collective calls at the same step:
  - when: step numbers only (`memplan.Schedule`, pure). `snapshot_every=N`: every step divisible by N.
    "auto": the first snapshot after MEASURE_STEPS calls of `step()`, the second MEASURE_STEPS
    later, then every N steps, N the largest interval any rank proposes (`memplan.auto_interval`: its
    measured cost, the copy it waited for plus what the background write added to the steps it
    overlapped, over BUDGET of its median step), agreed at each snapshot, printed once.
  - whether it fits: each rank checks the node's tmpfs and MemAvailable (`memplan.refusal`) for
    its node's share with headroom; the MAX over ranks is the verdict. A refusal is one warning,
    and the tier is off for the rest of this process: never an OOM kill of the training.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.layout import MARKER, saving_dirs, step_dirs
from ..contract import ENV_MEMORY_DIR, ENV_MEMORY_LIMIT, ENV_SNAPSHOT_EVERY
from ..errors import ConfigError, SaveError
from ..events import EV_MEMORY_REFUSED, try_append_event
from .memplan import BUDGET, Cost, Schedule, refusal, setting

if TYPE_CHECKING:
    from ..checkpoint.collective import Group
    from .asyncsave import AsyncWriter
    from .saving import Payload

log = logging.getLogger("slurmresume")


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
            self.pending = self.writer.last_blocking_s
            self.cost.blocked = time.perf_counter() - began

    def _checked(self, step: int, payload: Payload) -> Payload:
        """Training thread, nothing in flight: the collective fit check and the interval agreement."""
        mine = sum(t.numel() * t.element_size() for _, t in payload.tensors)
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        pool_new = 0 if self.writer.pool.nbytes else mine  # the writer's buffers, made by the first snapshot
        why = refusal(mine * local, _shm_free(self.root), *_meminfo(), self.limit, buffers=pool_new * local)
        refused, agreed = self.group.max_ints([int(why is not None), self.cost.proposal()])
        if refused:
            self.off = True
            if self.group.rank == 0:
                why = why or "on another rank's node"
                log.warning("memory tier off for this run: a snapshot of step %d would not fit in this node's memory "
                            "(%s); training continues with the file tier", step, why)
                try_append_event(self.file_root, EV_MEMORY_REFUSED, step=step, reason=why)
            raise _Refused
        if self.schedule.every is None:
            self.schedule.taken(agreed)
            if agreed and not self.printed and self.group.rank == 0:
                self.printed = True
                log.info("memory tier: a snapshot every %d step(s) (auto: the measured cost kept under %g%% of "
                         "the step time)", agreed, BUDGET * 100)
        return payload

    def _write(self, step: int, snapshot: Payload, blocking_s: float) -> None:
        """Writer thread, every rank: the collective save into the memory root; a failure is a
        warning (rank 0), never an error for training. Rank 0 then frees the older snapshots."""
        from .saving import save_collective

        try:
            result = save_collective(self.group, self.root, step, snapshot, replace_if_changed=False, emergency=True)
        except (SaveError, OSError) as exc:
            if self.group.rank == 0:
                log.warning("memory snapshot of step %d failed: %s", step, exc)
            return
        if self.group.rank != 0:
            return
        if result.outcome is not None and not result.outcome.ok:
            log.warning("memory snapshot of step %d failed: %s", step, result.outcome.error)
            return
        if not result.skipped:
            log.debug("memory snapshot of step %d: %d bytes, copy %.3f s", step, result.bytes, blocking_s)
        prune(self.root, step)

    def forget_from(self, step: int) -> None:
        """Rank 0, after an explicit save of `step` replaced what the file tier held: the memory
        snapshots of `step` and later no longer hold what the run saved last."""
        forget_from(self.root, step)


class _Refused(Exception):
    pass


def forget_from(root: Path, step: int) -> None:
    """Rank 0: every memory snapshot of `step` or later, gone (they are of another trajectory than
    the one the run now holds). Never raises."""
    for s, path in step_dirs(root):
        if s >= step:
            remove_step(path)


def prune(root: Path, newest: int) -> None:
    """Rank 0, once `newest` committed in the memory root (this job's alone, on this node): every
    older step, committed or left by a killed writer, is removed (marker first). Never raises."""
    for s, path in step_dirs(root) + saving_dirs(root):
        if s < newest:
            remove_step(path)


def remove_step(path: Path) -> None:
    """A step directory of the memory root, gone (its marker first: never seen committed and partial)."""
    try:
        os.unlink(path / MARKER)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def _shm_free(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


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

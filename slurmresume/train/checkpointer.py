"""The library's front door: `Checkpointer`, used on every rank of a training script.

Call order (every rank, same order):
    ckpt = Checkpointer()                 # collective when torch.distributed is initialised
    step = ckpt.restore(state)            # 0 on a fresh start
    while step < total:
        ...train one step...
        step += 1
        ckpt.step(step, state, metrics=...)   # periodic save + warning-signal handling
    ckpt.close()
"""

from __future__ import annotations

import atexit
import contextlib
import os
import time
from collections.abc import Collection, Iterator, Mapping, MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..beatfile import BUSY, DONE, RESTORE, SAVE
from ..checkpoint.layout import step_dir_name
from ..checkpoint.store import CheckpointInfo
from ..errors import ConfigError
from .claims import lost
from .ddptrack import DDPTracker

if TYPE_CHECKING:  # the front door's types, for a reader and a type checker; imported where used
    from ..mirror.background import Mirror
    from ..retention import RetentionPolicy
    from ..storage.s3 import S3Location
    from .savepolicy import SavePolicy
from .drillhang import drill_hang_here
from .emergency import save_and_exit
from .failsave import failure_guard
from .heartbeat import expect_io, phase
from .memplan import setting
from .memtier import MemoryTier
from .options import check_options
from .restoreload import Request
from .restoring import restore_and_record
from .roots import ENV_ROOT as ENV_ROOT  # re-exported (train.checkpointer.ENV_ROOT)
from .roots import claim_root, resolve_root
from .saving import Payload, after_commit, payload_of, save_and_record, tolerated
from .steprecord import INTERNAL_SAVES, recorder_from_env
from .wiring import wire


class Checkpointer:
    """Saves and restores a training state dict on every rank.

    Args (keyword-only):
        root: checkpoint root directory; default `$SLURMRESUME_CKPT_DIR`.
        save_every: periodic save every N steps (None: only on the warning signal / explicit save).
        verify_on_restore: recompute shard checksums before loading (sizes are always checked).
        handle_signals: install the flag-only handlers for the warning signal
            (`$SLURMRESUME_SIGNAL`, default USR1) and SIGTERM.
        exit_on_signal: after the emergency save, exit the process (75 preempted, 76 terminated)
            so the launcher requeues; False returns True from `step()` instead.
        retention: a `RetentionPolicy` applied on rank 0 after each commit.
        on_save_error: "raise" (default) or "warn" for periodic saves; an emergency save always
            raises, since continuing would lose the work the signal asked to keep.
        async_save: periodic saves from `step()` snapshot the tensors into reused CPU buffers
            (pinned, on a side stream, for CUDA), return, and write + commit in a background
            thread. At most one is in flight; errors surface on the training thread at the next
            `step()`/`save()`/`wait()`. An emergency save waits for it, then saves synchronously.
        async_overlap: when a periodic async save is due while one is still in flight: "wait"
            (default: never drop a save; training stalls for the remaining write) or "skip".
        save_policy: a `SavePolicy` (every N steps, every T seconds, at epoch ends, or
            interval="auto": Young/Daly from the measured save cost and failure rate);
            `save_every=N` is short for SavePolicy(every_steps=N).
        mirror: "s3://BUCKET/PREFIX" (default `$SLURMRESUME_MIRROR`, set by `submit --mirror`):
            rank 0 uploads every committed step there in the background (marker last, with a
            conditional write); `restore` first downloads a newer complete step from it (verified).
            See slurmresume/mirror/.
        snapshot_every: the memory tier (train/memtier.py), under the launcher only (it owns the
            node's memory root, $SLURMRESUME_MEMORY_DIR): every N steps each rank's state is also
            snapshotted there in the background, and a restart inside the allocation restores
            from it first. "auto" (default, or `submit --snapshot-every`): as often as keeps its
            measured cost under 2% of the step time; "off" or 0: none.
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        save_every: int | None = None,
        verify_on_restore: bool = False,
        handle_signals: bool = True,
        exit_on_signal: bool = True,
        retention: RetentionPolicy | None = None,
        on_save_error: str = "raise",
        async_save: bool = False,
        async_overlap: str = "wait",
        save_policy: SavePolicy | None = None,
        mirror: str | os.PathLike[str] | S3Location | Mirror | None = None,
        snapshot_every: int | str | None = None,
    ) -> None:
        self._created_at = time.time()  # the script's imports, process group and model are done
        check_options(save_every, async_overlap, retention, on_save_error, save_policy)
        if snapshot_every is not None:
            setting(snapshot_every)  # a ConfigError before anything is set up
        self.root = resolve_root(root)
        self.save_every = save_every
        self.verify_on_restore = verify_on_restore
        self.exit_on_signal = exit_on_signal
        self.retention = retention
        self.on_save_error = on_save_error
        self.async_save = async_save
        self.async_overlap = async_overlap
        self.last_saved_step: int | None = None
        self.restored: CheckpointInfo | None = None
        # gloo groups still alive at interpreter teardown can abort the process ("terminate
        # called without an active exception") after a successful run; release ours at exit
        # even when the script forgets close(). Local only: no collective runs at exit.
        self._closed = True  # until wired: nothing to finish or release at exit
        self._guard = None
        atexit.register(self._release_at_exit)
        w = self._wiring = wire(self.root, root, save_every=save_every, save_policy=save_policy, retention=retention,
                                mirror=mirror, handle_signals=handle_signals)
        self._closed = False
        self.group, self.agree_group, self.flag, self.mirror = w.group, w.agree_group, w.flag, w.mirror
        self.save_policy = w.sched.policy
        self._sched, self._async, self._beat, self._boundary = w.sched, w.writer, w.beat, w.boundary
        self._drill_hang, self._first_save = w.drill_hang, w.drill_first_save
        self._ddp = DDPTracker()  # the DDP wrappers whose bucket layouts are saved (train/ddptrack.py)
        self._record = recorder_from_env(self.rank)  # under `slurmresume drill` only
        self._guard = failure_guard(self.group, self.root)  # the failure-time save (train/failsave.py)
        self._memory = MemoryTier.from_env(snapshot_every, self.group, self._async, self.root)  # train/memtier.py
        if self._guard is not None:  # a dead FSDP2 rank's pieces from its memory snapshot (train/memshard.py)
            self._guard.memory = self._memory

    @property
    def rank(self) -> int:
        return self.group.rank

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, metrics: Any = None, meta: Any = None,
             reason: str = "explicit", partial_epoch_metrics: Collection[str] = ()) -> Path | None:
        """Collective, synchronous. Save `state` as step `step` (after any in-flight async save);
        returns the committed directory, or None when the step was already committed with this
        very state. Raises SaveError on every rank if any rank failed; no marker is written then.

        Final saves: when `step` is already committed (a periodic save of the same step) and the
        state differs from it on any rank (tensors, plain values, RNG states; not metrics), the
        step is saved again and the new checkpoint replaces the old one atomically, once it is
        itself committed: state changed after the loop (a final evaluation, `best_val_loss`) is
        never lost. Saves from `step()` (periodic, emergency) never replace a committed step.
        `partial_epoch_metrics`: as for `step()`."""
        if self._record is not None and reason not in INTERNAL_SAVES:
            self._record.record(step, "save", metrics, partial_epoch_metrics)
        with phase(self._beat, SAVE, measured_save=True):
            self.wait()
            started = time.perf_counter()
            payload = self._prepare_payload(step, state, metrics, meta)
            expect_io("save", sum(t.numel() * t.element_size() for _, t in payload.tensors))  # the budget scales with it
            return self._save_now(step, payload, reason, started, None)  # blocking for all of it

    def save_async(self, step: int, state: Mapping[str, Any], *, metrics: Any = None, meta: Any = None,
                   reason: str = "async") -> bool:
        """Collective. Snapshot now, write + commit in the background. Returns False when skipped
        (`async_overlap="skip"` and a save is in flight)."""
        def write(snapshot: Payload, started: float, blocking_s: float) -> None:  # on the writer thread
            self._save_now(step, snapshot, reason, started, blocking_s)

        return self._async.save(step, self.async_overlap, lambda: self._prepare_payload(step, state, metrics, meta),
                                write)

    def wait(self) -> None:
        """Block until the in-flight async save (if any) has committed; re-raise its error here."""
        self._async.wait()

    def _prepare_payload(self, step: int, state: Mapping[str, Any], metrics: Any, meta: Any) -> Payload:
        self._check_open()  # a seam: tests/helpers/train_forgets_scheduler.py wraps this method
        if self._ddp.found is None:
            self._ddp.search(state)
        return payload_of(step, state, metrics, meta, self._ddp.for_save())

    def _save_now(self, step: int, payload: Payload, reason: str, started: float,
                  blocking_s: float | None) -> Path | None:
        """Collective, on the training thread or the writer thread: the save and its record
        (`saving.save_and_record`), then this rank's bookkeeping, in this order. Refused on every
        rank (RootOwnedError) when this run no longer owns the root (`roots.claim_root`)."""
        w = self._wiring
        w.lease_key = claim_root(self.group, self.root, w.lease_key, saving=True)
        cost = save_and_record(self.group, self.root, step, payload, reason, started, blocking_s, self._sched)
        self.last_saved_step = step
        if cost is None:  # already committed with this very state
            return None
        self._boundary.saved()
        self._sched.saved(step, cost)
        after_commit(self.root, self.rank, step, reason, self.retention, self.mirror)
        if reason == "explicit" and self._memory is not None and self._memory.leader:  # each node's copy
            self._memory.forget_from(step)  # the memory tier's copy of this step (or later) is not what was saved
        return self.root / step_dir_name(step)

    # -- the per-step hook ----------------------------------------------------------------

    def step(self, step: int, state: Mapping[str, Any], *, metrics: Any = None, meta: Any = None,
             epoch_end: bool = False, partial_epoch_metrics: Collection[str] = ()) -> bool:
        """Collective, call after each completed step (pass `epoch_end=True` after the last step
        of an epoch). Agrees across ranks whether a warning signal (or SIGTERM) arrived on any
        rank; if so all ranks save this same step and exit (or return True when
        `exit_on_signal=False`). Otherwise saves when the save policy says so.
        With several ranks the agreement is pipelined (see LaggedMax): a signal that arrives
        during step k is acted on at step k+1 by every rank, so no step pays a round trip. A
        time-based save is decided by rank 0's clock and travels in the same agreement.

        `partial_epoch_metrics`: keys of `metrics` that aggregate an epoch this process ran only
        part of (it restored in the middle of it, and the aggregate's accumulators are not in
        `state`: a framework's epoch mean). `slurmresume drill` does not compare them at this
        step and says so; they are saved like any other metric."""
        if self._drill_hang is not None and step >= self._drill_hang:
            drill_hang_here(step)  # as a hang in the training step would: before this step's heartbeat
        if self._record is not None:
            self._record.record(step, "step", metrics, partial_epoch_metrics)
        self._ddp.step_boundary()
        if self._guard is not None:  # this boundary's small state, published (no collective after the first)
            if self._ddp.found is None:
                self._ddp.search(state)
            self._guard.at_step(step, state, metrics, meta, self.group, self._ddp.for_save())
        if self._beat is not None:
            self._beat.beat_step(step)
        trigger = self._sched.trigger(step, epoch_end=epoch_end)
        if trigger is None and self.rank == 0 and lost(self._wiring.lease_key):
            trigger = "seconds"  # rank 0 lost the root: the save this posts is refused on every rank
        verdict = self._boundary.decide(step, trigger)
        if verdict.emergency:
            return save_and_exit(self, step, state, verdict.signal, metrics, meta)
        if self._async.failed():  # the background save's error surfaces here, on the training thread
            with tolerated(self.on_save_error, self._sched):
                self.wait()
        if self._first_save:
            self._first_save = False
            if step != self.last_saved_step:
                self.save(step, state, metrics=metrics, meta=meta, reason="drill_first")  # (then no periodic one)
        if verdict.save is not None and step != self.last_saved_step:
            with tolerated(self.on_save_error, self._sched):
                if self.async_save:
                    self.save_async(step, state, metrics=metrics, meta=meta, reason="periodic")
                else:
                    self.save(step, state, metrics=metrics, meta=meta, reason="periodic")
        if self._memory is not None:  # the memory tier's snapshot, when due (in the background)
            with tolerated(self.on_save_error, self._sched):
                self._memory.at_step(step, lambda: self._prepare_payload(step, state, metrics, meta))
        return False

    def _release_at_exit(self) -> None:
        """atexit: the script ended without close(). Finish an async save in flight, which may
        exit the process (`AsyncWriter.finish_at_exit`), then release. Local only."""
        if self._closed:
            return
        if self._guard is not None:
            self._guard.at_exit()  # a peer died and broke our collective: the failure save exits
        self._async.finish_at_exit(self.on_save_error)
        self._closed = True
        self._wiring.release()

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed: create a new one to save or restore")

    # -- restoring ------------------------------------------------------------------------

    def restore(self, state: MutableMapping[str, Any], *, step: int | None = None,
                verify: bool | None = None, restore_rng: bool = True, strict: bool = True,
                allow_fresh_start: bool | None = None) -> int:
        """Collective. Load the newest complete checkpoint (or exactly `step`) into `state`:
        `load_state_dict` on stateful objects, plain values assigned into the mapping, RNG
        states restored. Returns the restored step, or 0 on a fresh start (logged once).
        A newer incomplete or corrupt directory is skipped with a warning naming it.

        Every byte loaded is checked against the digests recorded at save time (`verify=True`
        adds a whole-shard checksum pass first). When the root holds committed step directories
        but none of them loads, restore refuses to start from step 0 (CheckpointError) unless
        `allow_fresh_start=True` (default: $SLURMRESUME_ALLOW_FRESH_START == "1")."""
        self._check_open()
        with phase(self._beat, RESTORE):
            self._ddp.search(state)  # before the load: the layout is pinned right after it
            req = replace(Request.of(step, self.verify_on_restore if verify is None else verify, restore_rng, strict,
                                     allow_fresh_start), ddp_buckets=self._ddp)
            info = restore_and_record(self.group, self.root, state, req, self.mirror, created_at=self._created_at,
                                      memory=self._memory.root if self._memory is not None else None)
            self._ddp.watch(state)  # a wrapper created after this restore: ddptrack
            if info is None:
                return 0
            self.restored, self.last_saved_step = info, info.step
            self._first_save = False  # a resumed run: its first step is not the run's first
            self._sched.restored(info.step)
            self._boundary.restored(info.step)
            return info.step

    def track_ddp(self, key: str, wrapper: Any) -> None:
        """Every rank, before the wrapper's first forward. Record the bucket layout of a
        DistributedDataParallel `wrapper` under `key`, and pin the one restored for `key`: for a
        wrapper of something that is not a module in `state` (a framework's own wrapper). A DDP
        wrapper of a module in `state` is found without this, also when created after restore()."""
        self._ddp.adopt(key, wrapper)

    @contextlib.contextmanager
    def busy(self, what: str = "busy", *, budget_s: float | None = None) -> Iterator[None]:
        """Local (any rank). Wrap long work between step() calls (an evaluation, a final test):
        `with ckpt.busy("eval"): evaluate()`. The launcher's hang watch then allows it the busy
        budget (`--hang-busy`, default 900 s), or `budget_s` when given, and never less than the
        step budget (wrapping never shortens what the work may take). No-op when run without the
        launcher."""
        if budget_s is not None and not budget_s > 0:
            raise ConfigError(f"ckpt.busy({what!r}, budget_s={budget_s!r}): give a positive number of seconds")
        with phase(self._beat, BUSY, budget_s=budget_s or 0.0):
            yield

    def close(self) -> None:
        """Wait for an in-flight async save, restore the previous signal handlers, release the
        side process groups. Idempotent. Collective with several ranks (it drains the pending
        agreement)."""
        if self._closed:
            return
        self._closed = True
        if self._guard is not None:
            self._guard.close()
        if self._beat is not None:
            self._beat.enter(DONE)
        behind = False
        try:
            self._boundary.drain()
            self.wait()
            if self.mirror is not None:
                behind = not self.mirror.close()  # the final step reaches the bucket before the run ends
        finally:
            self._wiring.release()
        if behind:
            from ..mirror.hook import exit_behind

            exit_behind(self.mirror, self.root)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping, MutableMapping
from pathlib import Path
from typing import Any

from . import rng
from .checkpoint import calibrate as _calibrate
from .checkpoint import commit as _commit
from .checkpoint.collective import Group, LaggedMax
from .checkpoint.jsonenc import encode, loads
from .checkpoint.layout import MARKER, step_dir_name, step_dirs
from .checkpoint.manifest import read_manifest
from .checkpoint.replicas import elastic, replicated_names, tensor_digests
from .checkpoint.reshard import is_dtensor, load_sharded
from .checkpoint.reshard import targets as reshard_targets
from .checkpoint.same import same_as_committed
from .checkpoint.shard import SKELETON_KEY, load_tensors, meta_tensors, read_header
from .checkpoint.sharding import from_json
from .checkpoint.sharding import to_json as sharding_json
from .checkpoint.state import (
    apply_entries,
    check_fits,
    decode_entries,
    flatten,
    flatten_live,
    referenced,
    validate_skeleton,
)
from .checkpoint.store import CheckpointInfo, clean_temp_files, find_latest, inspect_dir
from .contract import (
    ENV_ALLOW_FRESH_START,
    ENV_DRILL_FIRST_SAVE,
    ENV_LAUNCHER_PID,
    ENV_RESTART,
    ENV_RUN_ID,
    EV_EMERGENCY_SAVE_FAILED,
    EXIT_SAVE_FAILED,
    Outcome,
    write_outcome,
)
from .errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    SaveError,
    UnsafeCheckpointError,
)
from .events import append_event, read_events
from .heartbeat import BUSY, DONE, RESTORE, SAVE, beat_from_env, drill_hang_here, drill_hang_step
from .logs import ensure_handler
from .logs import size as log_size
from .signals import (
    EXIT_PREEMPTED,
    EXIT_TERMINATED,
    NONE,
    PREEMPT,
    SignalFlag,
    warning_signal_from_env,
)
from .snapshot import SnapshotPool

log = logging.getLogger("slurmresume")

ENV_ROOT = "SLURMRESUME_CKPT_DIR"
DRILL_RELAY_WAIT_S = 30.0  # how long a drill rank waits for the launcher to relay its warning
EMERGENCY_REASONS = ("preempt", "terminate")  # save reasons after a signal: no retention then
RETENTION_LOCK_WAIT_S = 1.0  # retention after a periodic commit skips a round rather than wait


def resolve_root(root: str | os.PathLike[str] | None) -> Path:
    """The checkpoint root: the argument, else $SLURMRESUME_CKPT_DIR. Refuses a file."""
    value = root if root is not None else os.environ.get(ENV_ROOT)
    if value is None or str(value) == "":
        raise ConfigError(f"no checkpoint root: pass Checkpointer(root=...) or set {ENV_ROOT}")
    from .mirror.hook import refuse_bucket_root

    refuse_bucket_root(value, "mirror=")  # not a local folder named "s3:"
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint root {path} is a file, not a directory: choose a directory path")
    return path


_ERROR_TYPES = {c.__name__: c for c in (ConfigError, CheckpointError, CorruptCheckpointError, UnsafeCheckpointError)}


def _drill_step() -> int | None:
    """`slurmresume drill`: the step at which this run (restart k) injects its warning, from
    $SLURMRESUME_DRILL_AT="12,30,41" (entry k for restart k)."""
    planned = [int(x) for x in os.environ.get("SLURMRESUME_DRILL_AT", "").split(",") if x.strip().isdigit()]
    k = int(os.environ.get("SLURMRESUME_RESTART_COUNT") or 0)
    return planned[k] if k < len(planned) else None


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
    """

    def __init__(
        self,
        root: str | os.PathLike[str] | None = None,
        *,
        save_every: int | None = None,
        verify_on_restore: bool = False,
        handle_signals: bool = True,
        exit_on_signal: bool = True,
        retention: Any = None,
        on_save_error: str = "raise",
        async_save: bool = False,
        async_overlap: str = "wait",
        save_policy: Any = None,
        mirror: Any = None,
    ) -> None:
        if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
            raise ConfigError(f"save_every must be a positive integer or None, got {save_every!r}")
        if async_overlap not in ("wait", "skip"):
            raise ConfigError(f"async_overlap must be 'wait' or 'skip', got {async_overlap!r}")
        from .retention import RetentionPolicy

        if retention is not None and not isinstance(retention, RetentionPolicy):
            raise ConfigError(f"retention must be a slurmresume.RetentionPolicy, got {type(retention).__name__}")
        if on_save_error not in ("raise", "warn"):
            raise ConfigError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
        self.root = resolve_root(root)
        self.save_every = save_every
        self.verify_on_restore = verify_on_restore
        self.exit_on_signal = exit_on_signal
        self.retention = retention
        self.on_save_error = on_save_error
        from .mirror.hook import mirror_for

        self.mirror = mirror_for(mirror, rank=-1)  # validates the URL (ConfigError) before any setup
        from .policy import SavePolicy, SaveScheduler, estimate_from_events

        if save_policy is not None and save_every is not None:
            raise ConfigError("pass either save_every or save_policy, not both")
        if save_policy is not None and not isinstance(save_policy, SavePolicy):
            raise ConfigError(f"save_policy must be a slurmresume.SavePolicy, got {type(save_policy).__name__}")
        self.save_policy = save_policy or SavePolicy(every_steps=save_every)
        self._sched = SaveScheduler(self.save_policy, history=estimate_from_events(read_events(self.root))
                                    if self.save_policy.interval == "auto" else None)
        self._time_due_posted = False
        self._blocking_s: float | None = None
        self._closed = False
        # gloo groups still alive at interpreter teardown can abort the process ("terminate
        # called without an active exception") after a successful run; release ours at exit
        # even when the script forgets close(). Local only: no collective runs at exit.
        atexit.register(self._release_at_exit)
        self.async_save = async_save
        self.async_overlap = async_overlap
        self._pool = SnapshotPool()
        self._inflight: threading.Thread | None = None
        self._async_error: BaseException | None = None
        self.group = Group.create()
        self._lease_key: tuple[str, str] | None = None
        self._claim_root()  # one owner per root: refused here, before anything is written
        self.agree_group = Group.create()
        self._agreement = LaggedMax(self.agree_group)
        self.mirror = mirror_for(mirror, rank=self.group.rank, retention=retention, on_event=self._event)
        self.last_saved_step: int | None = None
        self.restored: CheckpointInfo | None = None
        ensure_handler()  # the training log shows restored / warning / saved lines without setup
        self.flag = SignalFlag(warning_signal_from_env()) if handle_signals else None
        self._drill = _drill_step()
        # the launcher's hang watch (heartbeat.py): one pwrite per step(); None when run bare
        self._beat = beat_from_env(self.group.rank)
        self._drill_hang = drill_hang_step(self.group.rank)
        # drill: both runs save their first step, so that what differs between them before any
        # warning (an RNG stream the script never seeds) is not blamed on the resume
        self._first_save = os.environ.get(ENV_DRILL_FIRST_SAVE) == "1" and not int(os.environ.get(ENV_RESTART) or 0)
        self._check_root_conflict(root)
        if self.flag is not None and not self.flag.install():
            log.warning("not in the main thread: warning-signal handlers not installed")
            self.flag = None

    @property
    def rank(self) -> int:
        return self.group.rank

    def _claim_root(self) -> None:
        """Collective. Rank 0 takes or checks the root's lease (ownership.py); a refusal is raised
        on every rank (no rank is left waiting in a collective)."""
        from .ownership import RootOwnedError, for_checkpointer

        error = None
        if self.rank == 0:
            try:
                self._lease_key = for_checkpointer(self.root)
            except RootOwnedError as exc:
                error = str(exc)
        error = self.group.broadcast_json(error)
        if error:
            self._closed = True
            self.group.destroy()
            raise RootOwnedError(error)

    def _check_root_conflict(self, root: str | os.PathLike[str] | None) -> None:
        """An explicit root that differs from the launcher's ($SLURMRESUME_CKPT_DIR, set by
        `submit`/`drill`) silently moves every checkpoint where the launcher, `status` and the
        drill do not look: warn loudly naming both, and leave a `root_conflict` event in the
        launcher's root so that the drill can say why it found nothing there."""
        launcher = os.environ.get(ENV_ROOT)
        if root is None or not launcher or Path(launcher).expanduser().resolve() == self.root.resolve():
            return
        if self.rank == 0:
            log.warning("Checkpointer(root=%s) overrides the launcher's %s=%s: checkpoints go to %s, where the "
                        "launcher (requeue), `slurmresume status` and `slurmresume drill` do not look; pass "
                        "root=None to use the launcher's root", self.root, ENV_ROOT, launcher, self.root)
            try:
                append_event(Path(launcher), "root_conflict", script_root=str(self.root), launcher_root=launcher)
            except OSError as exc:
                log.warning("could not record the root conflict under %s: %s", launcher, exc)

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, metrics: Any = None, meta: Any = None,
             reason: str = "explicit") -> Path | None:
        """Collective, synchronous. Save `state` as step `step` (after any in-flight async save);
        returns the committed directory, or None when the step was already committed with this
        very state. Raises SaveError on every rank if any rank failed; no marker is written then.

        Final saves: when `step` is already committed (a periodic save of the same step) and the
        state differs from it on any rank (tensors, plain values, RNG states; not metrics), the
        step is saved again and the new checkpoint replaces the old one atomically, once it is
        itself committed: state changed after the loop (a final evaluation, `best_val_loss`) is
        never lost. Saves from `step()` (periodic, emergency) never replace a committed step."""
        began = self._beat.enter(SAVE) if self._beat is not None else 0.0
        try:
            self.wait()
            started = time.perf_counter()
            skeleton, tensors, enc = self._prepare_payload(step, state, metrics, meta)
            self._blocking_s = None  # a synchronous save blocks for all of it
            return self._write_and_commit(step, skeleton, tensors, enc, reason, started)
        finally:
            if self._beat is not None:
                self._beat.leave(began, measured_save=True)

    def save_async(self, step: int, state: Mapping[str, Any], *, metrics: Any = None, meta: Any = None,
                   reason: str = "async") -> bool:
        """Collective. Snapshot now, write + commit in the background. Returns False when skipped
        (`async_overlap="skip"` and a save is in flight)."""
        if self._inflight is not None and self._inflight.is_alive() and self.async_overlap == "skip":
            log.info("step %d: previous async save still in flight, skipping this one", step)
            return False
        # waiting for the previous write and taking the snapshot are save time, not step time
        began = self._beat.enter(SAVE) if self._beat is not None else 0.0
        try:
            self.wait()
            started = time.perf_counter()
            skeleton, tensors, enc = self._prepare_payload(step, state, metrics, meta)
            copies, ready = self._pool.snapshot(tensors)
        finally:
            if self._beat is not None:
                self._beat.leave(began)
        self._blocking_s = time.perf_counter() - started  # what training paid (Young/Daly's C)
        # The step is taken care of from now on: the policy must not call it (or the next steps,
        # by the clock) due again while the write runs, or each timed save is written twice and
        # the second one waits for the first.
        self._sched.started(step)

        def run() -> None:
            try:
                ready()
                self._write_and_commit(step, skeleton, copies, enc, reason, started)
            except BaseException as exc:  # raised on the training thread by wait()
                self._async_error = exc

        self._inflight = threading.Thread(target=run, name=f"slurmresume-save-{step}", daemon=True)
        self._inflight.start()
        return True

    def wait(self) -> None:
        """Block until the in-flight async save (if any) has committed; re-raise its error here."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
        if self._async_error is not None:
            exc, self._async_error = self._async_error, None
            raise exc

    def _prepare_payload(self, step: int, state: Mapping[str, Any], metrics: Any,
                         meta: Any) -> tuple[dict, list, tuple[Any, Any]]:
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ConfigError(f"step must be a non-negative integer, got {step!r}")
        skeleton, tensors = flatten(state, {"rng": rng.capture()})
        return skeleton, tensors, (encode(metrics), encode(meta))

    def _write_and_commit(self, step: int, skeleton: dict, tensors: list, enc: tuple[Any, Any],
                          reason: str, started: float) -> Path | None:
        decision = self.group.broadcast_json(_commit.prepare(self.root, step) if self.rank == 0 else None)
        if decision["action"] == "skip" and reason == "explicit":
            same = same_as_committed(self.root / step_dir_name(step), step, self.rank, self.group.world_size,
                                     skeleton, tensors)
            if self.group.max_int(int(not same)):  # any rank's state differs: replace the step
                if self.rank == 0:
                    log.info("step %d is committed, but the state changed since: saving it again", step)
                decision = self.group.broadcast_json(_commit.prepare(self.root, step, replace=True)
                                                     if self.rank == 0 else None)
        if decision["action"] == "skip":
            self.last_saved_step = step
            return None
        if decision["action"] == "error":
            raise SaveError(f"checkpoint save failed, nothing committed: {decision['error']}")
        replicated: set[str] = set()
        if self.group.world_size > 1:  # data-parallel replicas are stored once (rank 0's shard)
            digests = tensor_digests(tensors, skeleton.get("dtensors"))
            replicated = replicated_names(self.group.all_gather_json(digests))
        into = decision["dir"]  # this save's private directory; the commit publishes it as step_N
        # an emergency save never spends its lead on measuring write paths (calibrate.choose)
        with _calibrate.emergency() if reason in EMERGENCY_REASONS else contextlib.nullcontext():
            report = _commit.write_rank(self.root, step, self.group, skeleton, tensors, replicated, into=into)
        reports = self.group.all_gather_json(report)
        outcome = _commit.commit(self.root, step, reports, *enc, into=into,
                                 replace=bool(decision.get("replace"))) if self.rank == 0 else None
        outcome = self.group.broadcast_json(outcome)
        seconds = time.perf_counter() - started
        if self.rank == 0:
            if outcome["ok"]:
                log.info("saved step %d in %.2f s (%s, %s)", step, seconds,
                         log_size(sum(int(r.get("bytes") or 0) for r in reports)), reason)
                self._event("save_committed", step=step, seconds=round(seconds, 4), reason=reason,
                            world_size=self.group.world_size, run_id=os.environ.get("SLURMRESUME_RUN_ID"),
                            blocking_s=None if self._blocking_s is None else round(self._blocking_s, 4),
                            interval_s=self._sched.interval_s,
                            bytes=sum(int(r.get("bytes") or 0) for r in reports),  # for leadtime.predict_save
                            writer=report.get("writer"))
            else:
                self._event("save_failed", step=step, error=outcome.get("error"), reason=reason)
        _commit.raise_if_failed(outcome)
        self.last_saved_step = step
        self._time_due_posted = False
        self._sched.saved(step, self._blocking_s if self._blocking_s is not None else seconds)
        # An emergency save must reach its exit (and the requeue) at once: retention waits for the
        # next run's first commit instead of holding the root lock or deleting files now.
        if self.rank == 0 and self.retention is not None and reason not in EMERGENCY_REASONS:
            self._apply_retention()
        if self.mirror is not None:  # rank 0: background upload, marker last
            self.mirror.enqueue(self.root, step)
        return self.root / step_dir_name(step)

    def _event(self, name: str, **fields: Any) -> bool:
        """Append to the event log; a failure (disk full, EIO) is logged, never raised: the log is
        a record, and a committed checkpoint must not turn into an error because of it."""
        try:
            append_event(self.root, name, **fields)
            return True
        except OSError as exc:
            log.warning("could not append %r to the event log under %s: %s", name, self.root, exc)
            return False

    def _apply_retention(self) -> None:
        from .retention import apply_policy

        if self.retention is None:
            return
        try:  # a short lock wait: a busy lock (a prune renaming) skips this round, never stalls training
            apply_policy(self.root, self.retention, lock_timeout=RETENTION_LOCK_WAIT_S)
        except Exception as exc:  # retention must never break training
            log.warning("retention after commit failed: %s", exc)

    # -- the per-step hook ----------------------------------------------------------------

    def step(self, step: int, state: Mapping[str, Any], *, metrics: Any = None, meta: Any = None,
             epoch_end: bool = False) -> bool:
        """Collective, call after each completed step (pass `epoch_end=True` after the last step
        of an epoch). Agrees across ranks whether a warning signal (or SIGTERM) arrived on any
        rank; if so all ranks save this same step and exit (or return True when
        `exit_on_signal=False`). Otherwise saves when the save policy says so.
        With several ranks the agreement is pipelined (see LaggedMax): a signal that arrives
        during step k is acted on at step k+1 by every rank, so no step pays a round trip. A
        time-based save is decided by rank 0's clock and travels in the same agreement."""
        if self._drill_hang is not None and step >= self._drill_hang:
            drill_hang_here(step)  # as a hang in the training step would: before this step's heartbeat
        if self._beat is not None:
            self._beat.beat_step(step)
        if self._drill is not None and self.rank == 0 and step >= self._drill:
            self._inject_drill_signal(step)
        local = self.flag.request if self.flag is not None else NONE
        trigger = self._sched.trigger(step, epoch_end=epoch_end)
        time_due = trigger == "seconds" and self.rank == 0 and not self._time_due_posted
        if time_due and self.group.world_size > 1:
            self._time_due_posted = True
        agreed = self._agreement.exchange(local * 2 + int(time_due))
        if agreed % 2:
            # rank 0's posted "time due" came back: it may post again, whatever this save's fate
            # (a failed save must not stop time-based saves for the rest of the run)
            self._time_due_posted = False
        if agreed // 2 != NONE:
            return self._emergency(step, state, agreed // 2, metrics, meta)
        self._check_async_error()
        if self._first_save:
            self._first_save = False
            if step != self.last_saved_step:
                self.save(step, state, metrics=metrics, meta=meta, reason="drill_first")
                return False
        if trigger in ("steps", "epoch") or agreed % 2 or (trigger == "seconds" and self.group.world_size == 1):
            self._periodic(step, state, metrics, meta, trigger or "seconds")
        return False

    def _periodic(self, step: int, state: Mapping[str, Any], metrics: Any, meta: Any, why: str) -> None:
        if step == self.last_saved_step:
            return
        try:
            if self.async_save:
                self.save_async(step, state, metrics=metrics, meta=meta, reason="periodic")
            else:
                self.save(step, state, metrics=metrics, meta=meta, reason="periodic")
        except SaveError as exc:
            if self.on_save_error == "raise":
                raise
            self._sched.failed()
            log.warning("%s; training continues without this checkpoint", exc)

    def _release_at_exit(self) -> None:
        """atexit: the script ended without close(). An async save still in flight is finished
        here (its thread is a daemon, which the interpreter would otherwise freeze mid-write);
        if it failed and on_save_error is "raise", the process exits with EXIT_SAVE_FAILED and
        one line on stderr instead of 0. Local only: the writer's collectives pair up with the
        other ranks' writers, which finish the same way."""
        if self._closed:
            return
        if self._inflight is not None and self._inflight.is_alive():
            log.warning("the script ended while an async save was in flight (no ckpt.close()): finishing it")
            self._inflight.join()
        if self._async_error is not None:
            exc, self._async_error = self._async_error, None
            if self.on_save_error == "raise":
                sys.stderr.write(f"slurmresume: the last async save failed and the script ended without "
                                 f"ckpt.close(): {exc}\n")
                sys.stderr.flush()
                os._exit(EXIT_SAVE_FAILED)
            log.warning("the last async save failed: %s", exc)
        self._closed = True
        self._teardown()

    def _teardown(self) -> None:
        """Local, after the last collective: the previous signal handlers back, the side process
        groups gone, and the root's lease freed if this was the process's last Checkpointer on it."""
        from .ownership import unclaim

        if self.flag is not None:
            self.flag.uninstall()
        for g in (self.agree_group, self.group):
            g.destroy()
        key, self._lease_key = self._lease_key, None
        unclaim(key)

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("this Checkpointer is closed: create a new one to save or restore")

    def _check_async_error(self) -> None:
        if self._async_error is None or (self._inflight is not None and self._inflight.is_alive()):
            return
        try:
            self.wait()
        except SaveError as exc:
            if self.on_save_error == "raise":
                raise
            self._sched.failed()
            log.warning("%s; training continues without this checkpoint", exc)

    def _inject_drill_signal(self, step: int) -> None:
        """`slurmresume drill`: send the warning signal to the launcher (as Slurm would), which
        relays it to every worker; the save lands at whichever step the ranks then agree on."""
        self._drill = None
        target = int(os.environ.get("SLURMRESUME_LAUNCHER_PID") or os.getpid())
        log.info("drill: warning signal at step %d to pid %d", step, target)
        os.kill(target, warning_signal_from_env())
        # The launcher relays on its own clock (every 0.1 s); a fast script could finish its
        # last steps before the relay lands, and the drill would prove nothing. Hold this rank
        # until the warning has reached it (other ranks learn of it through the agreement).
        deadline = time.monotonic() + DRILL_RELAY_WAIT_S
        while self.flag is not None and self.flag.request == NONE and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.flag is not None and self.flag.request == NONE:
            log.warning("drill: the warning signal did not reach rank 0 within %.0f s", DRILL_RELAY_WAIT_S)

    def _emergency(self, step: int, state: Mapping[str, Any], agreed: int, metrics: Any, meta: Any) -> bool:
        """Every rank: save the agreed step, then (rank 0) write the run's outcome record
        (contract.write_outcome): committed only when this save of `step` has its marker. A failed
        save is recorded too (committed=False, the error) and exits EXIT_SAVE_FAILED; the launcher
        then resumes from the newest complete checkpoint."""
        kind = "preempt" if agreed == PREEMPT else "terminate"
        run_id = os.environ.get(ENV_RUN_ID)
        if self.rank == 0:
            log.warning("warning signal received (%s): saving step %d, then exiting", kind, step)
            self._event("signal_agreed", step=step, kind=kind, run_id=run_id)
        try:
            self.wait()
        except SaveError as exc:  # the emergency save below is what matters now
            log.warning("in-flight async save failed: %s", exc)
        if self.rank == 0:  # provisional: a crash during the save still tells the launcher the agreed step
            self._record_outcome(Outcome(run_id or "", kind, step, False, "the emergency save did not finish"))
        error = ""
        try:
            if step != self.last_saved_step:
                self.save(step, state, metrics=metrics, meta=meta, reason=kind)
        except (SaveError, CheckpointError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        committed = not error and (self.rank != 0 or (self.root / step_dir_name(step) / MARKER).exists())
        recorded = True
        if self.rank == 0:
            if committed:
                self._event("exit_after_save", step=step, kind=kind, run_id=run_id)
            else:
                error = error or f"step {step} has no commit marker"
                self._event(EV_EMERGENCY_SAVE_FAILED, step=step, kind=kind, run_id=run_id, error=error)
            recorded = self._record_outcome(Outcome(run_id or "", kind, step, committed, error))
        if self.exit_on_signal:
            self.mirror = None  # exit now: this step's upload is finished by the next run (Mirror.start)
        if not self.exit_on_signal:
            if error:
                raise SaveError(f"the emergency save of step {step} failed: {error}")
            if self.flag is not None:
                self.flag.request = NONE
            return True
        try:
            self.close()
        except Exception as exc:  # noqa: BLE001 - exiting anyway; the record says what happened
            log.warning("close after the emergency save failed: %s", exc)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        if error:
            os._exit(EXIT_SAVE_FAILED)
        # Under our launcher the outcome record says what happened, and a zero exit keeps torchrun
        # from reporting a failure and killing peers; run bare, or when the record could not be
        # written, the distinct code says it.
        if os.environ.get(ENV_LAUNCHER_PID) and recorded:
            os._exit(0)
        os._exit(EXIT_PREEMPTED if agreed == PREEMPT else EXIT_TERMINATED)

    def _record_outcome(self, outcome: Outcome) -> bool:
        """Rank 0. False when there is no run id (run bare) or the record could not be written."""
        if not outcome.run_id:
            return False
        try:
            write_outcome(self.root, outcome)
            return True
        except (OSError, ValueError) as exc:
            log.warning("could not write the outcome record of run %s under %s: %s", outcome.run_id, self.root, exc)
            return False

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
        began = self._beat.enter(RESTORE) if self._beat is not None else 0.0
        try:
            return self._restore(state, step, verify, restore_rng, strict, allow_fresh_start)
        finally:
            if self._beat is not None:
                self._beat.leave(began)

    @contextlib.contextmanager
    def busy(self, what: str = "busy") -> Iterator[None]:
        """Local (any rank). Wrap long work between step() calls (an evaluation, a final test) so
        that the launcher's hang watch judges it by the start-up budget, not the step budget:
        `with ckpt.busy("eval"): evaluate()`. No-op when run without the launcher."""
        began = self._beat.enter(BUSY) if self._beat is not None else 0.0
        try:
            yield
        finally:
            if self._beat is not None:
                self._beat.leave(began)

    def _restore(self, state: MutableMapping[str, Any], step: int | None, verify: bool | None, restore_rng: bool,
                 strict: bool, allow_fresh_start: bool | None) -> int:
        self._restore_started = time.perf_counter()
        verify = self.verify_on_restore if verify is None else verify
        if allow_fresh_start is None:
            allow_fresh_start = os.environ.get(ENV_ALLOW_FRESH_START) == "1"
        tried: set[int] = set()
        dirty: int | None = None  # a failed attempt that had already written into live tensors
        dirty_error = ""
        while True:
            choice = self._choose_safely(step, verify or bool(tried), tried,
                                         allow_fresh_start or dirty is not None) if self.rank == 0 else None
            choice = self.group.broadcast_json(choice)
            if isinstance(choice, dict) and "error" in choice:  # raised on every rank, same type
                raise _ERROR_TYPES.get(choice.get("type", ""), CheckpointError)(choice["error"])
            if choice is None:
                if dirty is not None:
                    raise CheckpointError(f"restoring step {dirty} under {self.root} failed after it had "
                                          f"written into the model ({dirty_error}), and no older checkpoint loads: the "
                                          f"in-memory state is undefined; run `slurmresume verify --all "
                                          f"--ckpt-dir {self.root}` and restart")
                if step is not None:
                    raise CheckpointError(f"step {step} is not a complete checkpoint under {self.root}: "
                                          f"run `slurmresume status --ckpt-dir {self.root}` to list them")
                if self.rank == 0:
                    log.info("fresh start: no complete checkpoint under %s", self.root)
                return 0
            # Fast path (no checksum pass): read straight into the live tensors. With verification,
            # or when falling back, read into fresh memory so a bad file cannot touch the state.
            live = flatten_live(state)
            if choice["world_size"] != self.group.world_size and not choice["elastic"]:
                raise CheckpointError(
                    f"checkpoint {choice['path']} was written by {choice['world_size']} ranks, this run has "
                    f"{self.group.world_size}, and it holds per-rank (sharded) tensors: run with "
                    f"--nodes/--nproc-per-node giving {choice['world_size']} ranks")
            loaded, error, wrote = self._load_own_shard(choice, state, live, not (verify or tried), strict)
            errors = [e for e in self.group.all_gather_json(error) if e]
            if errors and self.group.max_int(int(wrote)):
                dirty, dirty_error = int(choice["step"]), errors[0]
            if not errors:
                assert loaded is not None
                self._apply(state, loaded, restore_rng, strict, choice)
                return int(choice["step"])
            if self.rank == 0:
                log.warning("checkpoint step %s (%s) unusable: %s; falling back to the previous one",
                            choice["step"], choice["path"], errors[0])
            if step is not None:
                raise CorruptCheckpointError(errors[0])
            tried.add(int(choice["step"]))

    def _choose_safely(self, step: int | None, verify: bool, tried: set[int], allow_fresh: bool) -> dict | None:
        try:
            choice = self._choose(step, verify, tried)
            if choice is None and step is None and not allow_fresh:
                refusal = self._fresh_start_refusal(tried)
                if refusal:
                    return {"error": refusal, "type": "CheckpointError"}
            if choice is not None:
                clean_temp_files(Path(choice["path"]))
            return choice
        except (CheckpointError, ConfigError, OSError) as exc:
            return {"error": str(exc), "type": type(exc).__name__}

    def _fresh_start_refusal(self, tried: set[int]) -> str | None:
        """Rank 0, when nothing loads: a root that holds committed step directories had progress;
        starting over from step 0 there would silently throw it away (a transient read error, a
        damaged disk). Directories without a marker (a save killed before its commit) do not count."""
        committed = [(s, p) for s, p in step_dirs(self.root) if (p / MARKER).exists()]
        if not committed:
            return None
        newest, path = committed[0]
        why = "it failed to load (see the warning above)" if newest in tried else inspect_dir(newest, path).problem
        return (f"refusing a fresh start: {self.root} holds {len(committed)} committed step "
                f"director{'y' if len(committed) == 1 else 'ies'} but none loads (newest {path.name}: {why}); "
                f"run `slurmresume verify --all --ckpt-dir {self.root}`, or pass "
                f"restore(..., allow_fresh_start=True) (or set {ENV_ALLOW_FRESH_START}=1) to start from step 0")

    def _choose(self, step: int | None, verify: bool, tried: set[int]) -> dict | None:
        if self.mirror is not None and not tried:  # rank 0: a newer (or the only) step may be on the bucket
            self.mirror.pull(self.root, step)  # step=N: fetched from the bucket if only it has N
            self.mirror.start(self.root)  # and finish an upload a requeued run left
        if step is not None:
            info = inspect_dir(step, self.root / step_dir_name(step), verify)
            if not info.complete:
                if info.has_marker:
                    raise CorruptCheckpointError(f"checkpoint {info.path}: {info.problem}")
                return None
        else:
            found = find_latest(self.root, verify=verify, exclude=tried)
            if found is None:
                return None
            info = found
        assert info.manifest is not None
        if not verify and not info.manifest.has_block_digests:
            # Written before per-block digests: no read can be checked as it happens, so check
            # the whole shards first (one extra read pass), and fall back like any corruption.
            info = inspect_dir(info.step, info.path, verify=True)
            if not info.complete:
                if step is not None:
                    raise CorruptCheckpointError(f"checkpoint {info.path}: {info.problem}")
                log.warning("skipping %s: %s", info.path, info.problem)
                return self._choose(step, verify, tried | {info.step})
        m = info.manifest
        assert m is not None
        return {"step": info.step, "path": str(info.path), "world_size": m.world_size,
                "shards": m.shards, "sharded": sharding_json(m.sharded), "elastic": elastic(m.tensors, m.world_size)}

    def _load_own_shard(self, choice: dict, state: MutableMapping[str, Any], live: dict[str, Any], fast: bool,
                        strict: bool) -> tuple[tuple[dict, Any] | None, str | None, bool]:
        """Read and decode this rank's part of a checkpoint without touching user objects, except
        on the fast path (`fast`), which reads straight into the live tensors. Returns
        ((decoded entries, library), error, wrote)."""
        # Rank r reads shard r; on a larger world, rank r >= W reads shard r % W (see _apply for
        # its RNG). Replicated tensors live in shard 0 only and are read from there. DTensor
        # pieces are read by box from whichever shards hold this rank's new region (reshard).
        src = self.rank if self.rank < choice["world_size"] else self.rank % choice["world_size"]
        shard, first = choice["shards"][src], choice["shards"][0]
        sharded = from_json(choice.get("sharded") or {})
        keys = list(state)
        wrote = False
        directory = Path(choice["path"])
        try:
            # Every byte read is checked against the digests the manifest recorded at save time
            # (hashing while reading); the manifest is re-read here, pinned by its marker.
            manifest = read_manifest(directory, int(choice["step"]))
            expect, expect0 = manifest.expected(src), manifest.expected(0)
            # Validate the skeleton against the headers first (no tensor bytes read yet), so a
            # malformed or mismatching checkpoint is refused before any live tensor is written.
            header, _ = read_header(directory, shard["file"], shard["bytes"], expect)
            meta = header.get("__metadata__")
            raw = meta.get(SKELETON_KEY, "") if isinstance(meta, dict) else ""
            skeleton = loads(raw, f"skeleton of {shard['file']}")
            names = {n for n in header if n != "__metadata__"} - set(sharded)
            listed = skeleton.get("replicated") or [] if isinstance(skeleton, dict) else []
            if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
                raise CorruptCheckpointError(f"skeleton of {shard['file']}: 'replicated' is not a list of names")
            shared = set(listed) - names - set(sharded)
            infos = {n: header[n] for n in names}
            if shared:
                header0 = read_header(directory, first["file"], first["bytes"], expect0)[0]
                infos.update({n: header0[n] for n in header0 if n in shared})
                names |= set(infos)
            validate_skeleton(keys, skeleton, names | set(sharded), strict)
            # Shapes from the headers (a DTensor: its global shape), as meta tensors: a checkpoint
            # that does not fit the live objects is refused before any byte is loaded.
            shapes = {**infos, **{n: {"dtype": t.dtype, "shape": list(t.shape)} for n, t in sharded.items()}}
            check_fits(state, decode_entries(keys, skeleton, meta_tensors(shapes), strict)[0])
            wanted = {n: sharded[n] for n in referenced(skeleton, keys) if n in sharded}
            where = reshard_targets(state, live, wanted, skeleton.get("dtensors") or {})
            plain = {n: t for n, t in live.items() if n not in sharded and not is_dtensor(t)} if fast else None
            tensors, _, wrote = load_tensors(directory, shard["file"], shard["bytes"], plain, names=names - shared,
                                             expect=expect)
            if shared:
                more, _, wrote2 = load_tensors(directory, first["file"], first["bytes"], plain, names=shared,
                                               expect=expect0)
                tensors.update(more)
                wrote = wrote or wrote2
            if wanted:
                more, wrote3 = load_sharded(directory, choice["shards"], wanted, where, fast, manifest.expected)
                tensors.update(more)
                wrote = wrote or wrote3
            decoded, library = decode_entries(keys, skeleton, tensors, strict)
            if self.rank < choice["world_size"] and isinstance(library, dict) and "rng" in library:
                rng.validate(library["rng"])  # before _apply touches anything
            return (decoded, library), None, wrote
        except CheckpointError as exc:
            return None, str(exc), wrote or getattr(exc, "partial_write", False)

    def _apply(self, state: MutableMapping[str, Any], loaded: tuple[dict, Any], restore_rng: bool,
               strict: bool, choice: dict) -> None:
        decoded, library = loaded
        apply_entries(state, decoded)
        saved_world = int(choice["world_size"])
        if self.rank >= saved_world:
            # No saved RNG for this rank: re-derive it from the step and rank (documented rule),
            # rather than cloning another rank's stream.
            rng.reseed(int(choice["step"]), self.rank)
            log.warning("rank %d: checkpoint %s has %d ranks; this rank's RNG is re-seeded from step and rank "
                        "and its per-rank state comes from rank %d", self.rank, choice["path"], saved_world,
                        self.rank % saved_world)
        elif restore_rng and isinstance(library, dict) and "rng" in library:
            rng.restore(library["rng"])
        if saved_world != self.group.world_size and self.rank == 0:
            log.warning("resharded: checkpoint %s was written by %d ranks, restored on %d (replicated tensors "
                        "from rank 0's shard, %d DTensor(s) read by box)", choice["path"], saved_world,
                        self.group.world_size, len(choice.get("sharded") or ()))
        self.last_saved_step = int(choice["step"])
        self._first_save = False  # a resumed run: its first step is not the run's first
        self._sched.restored(self.last_saved_step)
        if self._drill is not None:
            self._drill = max(self._drill, self.last_saved_step + 1)
        self.restored = inspect_dir(int(choice["step"]), Path(choice["path"]))
        if self.rank == 0:
            log.info("restored from step %d (%s) in %.2f s", int(choice["step"]), choice["path"],
                     time.perf_counter() - self._restore_started)
            self._event("restored", step=int(choice["step"]), run_id=os.environ.get("SLURMRESUME_RUN_ID"))

    def close(self) -> None:
        """Wait for an in-flight async save, restore the previous signal handlers, release the
        side process groups. Idempotent. Collective with several ranks (it drains the pending
        agreement)."""
        if self._closed:
            return
        self._closed = True
        if self._beat is not None:
            self._beat.enter(DONE)
        try:
            self._agreement.drain()
            self.wait()
            if self.mirror is not None:
                self.mirror.close()  # the final step reaches the bucket before the run ends
        finally:
            self._teardown()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

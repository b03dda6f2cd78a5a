"""The save sequence, as one collective function (`save_collective`), used by every kind of save:
`Checkpointer.save`, the writer thread of `save_async`, periodic and emergency saves; and what a
rank does around it: the payload it saves (`payload_of`), the record of the outcome
(`save_and_record`), retention and the mirror after a commit (`after_commit`), and the
`on_save_error` rule for periodic saves (`tolerated`).

Call order (every rank calls `save_collective` with the same step; "all" = every rank, in the
same order, "0" = rank 0 only; each arrow is one collective on the side group):

  1. 0:   `checkpoint.commit.prepare` creates this save's private `.saving.step_N.<token>/`
          (or finds the step committed: skip, or fails: error)        -> broadcast PrepareDecision
  2. all: only for an explicit save of a committed step: compare the live state with it
          (`checkpoint.same`); if any rank differs (MAX), 0 prepares again with replace=True
          -> broadcast PrepareDecision
  3. all: skip returns SaveResult(skipped=True); error raises SaveError on every rank.
  4. all: world > 1: data-parallel replicas are stored once (rank 0's shard): DTensors by
          placement, other tensors by digest (`checkpoint.replicas.replicated_across`)
          -> 2 MAX all_reduces of O(tensors) int64s (no exchange of indexes)
  5. all: `checkpoint.commit.write_rank` writes, fsyncs and renames this rank's shard and its
          tensor index into the private directory; an error is reported, not raised
          -> gather of fixed-size WriteReport records to rank 0 (`Group.gather_json`)
  6. 0:   `checkpoint.commit.commit`: manifest, COMMITTED, publish as step_N (or discard the
          directory when any report failed)                        -> broadcast SaveOutcome
  7. all: return SaveResult; the caller records it and raises when `outcome.ok` is False.

No rank leaves before step 6's broadcast, so no rank says "saved" before the step is durable,
and no rank raises between collectives (each failure travels as data to the next one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint import calibrate as _calibrate
from ..checkpoint import commit as _commit
from ..checkpoint.collective import Group
from ..checkpoint.jsonenc import encode
from ..checkpoint.layout import step_dir_name
from ..checkpoint.replicas import replicated_across
from ..checkpoint.reports import PrepareDecision, SaveOutcome, WriteReport
from ..checkpoint.same import same_as_committed
from ..checkpoint.state import flatten
from ..contract import ENV_RUN_ID
from ..errors import ConfigError, SaveError
from ..events import EV_SAVE_COMMITTED, EV_SAVE_FAILED, try_append_event
from . import ddp, rng
from .breakdown import Stopwatch, summarize
from .breakdown import describe as describe_breakdown
from .logs import size as log_size

if TYPE_CHECKING:
    from .savepolicy import SaveScheduler

log = logging.getLogger("slurmresume")

EMERGENCY_REASONS = ("preempt", "terminate")  # save reasons after a signal: no retention then
RETENTION_LOCK_WAIT_S = 1.0  # retention after a periodic commit skips a round rather than wait


@dataclass(frozen=True)
class Payload:
    """What one rank saves: the flattened state (`checkpoint.state.flatten`) and the encoded
    metrics and meta (`checkpoint.jsonenc.encode`; rank 0's go into the manifest)."""

    skeleton: dict[str, Any]
    tensors: list[Any]
    metrics: Any = None
    meta: Any = None


def payload_of(step: int, state: Mapping[str, Any], metrics: Any, meta: Any,
               ddp_buckets: Mapping[str, Any] | None = None) -> Payload:
    """Every rank, on the training thread: what this rank saves as step `step`, with the library's
    own state (the RNG streams, `rng.capture`; DDP bucket layouts, `ddp.capture`, collective when
    a rebuild is pending). A bad step is a ConfigError, before any collective."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ConfigError(f"step must be a non-negative integer, got {step!r}")
    library: dict[str, Any] = {"rng": rng.capture()}
    if ddp_buckets:
        library["ddp"] = ddp.capture(ddp_buckets)
    skeleton, tensors = flatten(state, library)
    return Payload(skeleton, tensors, encode(metrics), encode(meta))


@dataclass(frozen=True)
class SaveResult:
    """How a save ended, the same on every rank. `skipped`: the step was already committed with
    this state (no outcome, nothing written)."""

    skipped: bool
    outcome: SaveOutcome | None = None
    reports: tuple[WriteReport, ...] = ()
    breakdown: dict[str, Any] | None = None  # rank 0: where the seconds went (train.breakdown)
    into: str | None = None  # the save's private directory name (every rank), as rank 0 prepared it

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.reports)


def save_collective(group: Group, root: Path, step: int, payload: Payload, *, replace_if_changed: bool,
                    emergency: bool = False, dedup: bool = True,
                    on_prepared: Callable[[str], None] | None = None) -> SaveResult:
    """Collective (see the module docstring for the call order). `replace_if_changed`: an
    explicit save, which replaces a committed step whose state differs (periodic and emergency
    saves never replace one). `emergency`: a save after a signal, which never spends its lead
    measuring write paths (`checkpoint.calibrate.emergency`). `dedup=False`: every rank writes
    every tensor it holds, replicated or not (the memory tier on several nodes: each node's root
    then holds all its ranks read, see train/memtier.py). `on_prepared`: called with the name of
    the save's private directory once every rank has it, before any shard is written (the memory
    tier records which directory is this save's: train/memshard.py). Raises SaveError on every rank when the prepare fails; a failed
    write or commit is returned (`outcome.ok` False), for the caller to record, then raise."""
    sw = Stopwatch()
    # one exploration decision for the whole save (rank 0's ticket): a rank exploring alone would
    # gate every save of a large job on its slower path
    ticket = not emergency and sum(t.numel() * t.element_size() for _, t in payload.tensors) >= _calibrate.RECHECK_MIN_BYTES
    with sw("prepare"):
        decision = _decide(group, root, step, ticket=ticket)
    if decision.action == "skip" and replace_if_changed:
        same = same_as_committed(root / step_dir_name(step), step, group.rank, group.world_size,
                                 payload.skeleton, payload.tensors)
        if group.max_int(int(not same)):  # any rank's state differs: replace the step
            if group.rank == 0:
                log.info("step %d is committed, but the state changed since: saving it again", step)
            with sw("prepare"):
                decision = _decide(group, root, step, replace=True, ticket=ticket)
    if decision.action == "skip":
        return SaveResult(skipped=True)
    if decision.action == "error":
        raise SaveError(f"checkpoint save failed, nothing committed: {decision.error}")
    if on_prepared is not None:
        on_prepared(decision.dir)
    replicated: set[str] = set()
    if group.world_size > 1 and dedup:
        with sw("replica_digests"):  # hashing, and two fixed-size MAX all-reduces (replicas.py)
            replicated = replicated_across(group, payload.tensors, payload.skeleton.get("dtensors"))
    with sw("write"), _calibrate.emergency() if emergency else _calibrate.agreed(decision.explore):
        mine = _commit.write_rank(root, step, group, payload.skeleton, payload.tensors, replicated, into=decision.dir)
    with sw("collective"):
        records = group.gather_json(mine.record())  # fixed-size records, to rank 0 only
    outcome: SaveOutcome | None = None
    reports: tuple[WriteReport, ...] = (mine,)  # a rank other than 0 knows its own report only
    if records is not None:
        reports = tuple([mine, *(WriteReport.from_json(r) for r in records[1:])])  # rank 0's own: in full
        with sw("commit"):
            outcome = _commit.commit(root, step, list(reports), payload.metrics, payload.meta, into=decision.dir,
                                     replace=decision.replace)
    with sw("collective"):
        outcome = SaveOutcome.from_json(group.broadcast_json(outcome.to_json() if outcome else None))
    return SaveResult(skipped=False, outcome=outcome, reports=reports,
                      breakdown=summarize(reports, sw.seconds) if group.rank == 0 else None, into=decision.dir)


def _decide(group: Group, root: Path, step: int, replace: bool = False, ticket: bool = False) -> PrepareDecision:
    """Collective: rank 0 prepares (and, for a large non-emergency save, takes this save's
    exploration ticket: `calibrate.save_ticket`), every rank gets its decision."""
    mine = None
    if group.rank == 0:  # `replace` only when asked: fault campaigns wrap prepare(root, step)
        mine = _commit.prepare(root, step, replace=True) if replace else _commit.prepare(root, step)
        if ticket and mine.action == "write":
            mine = dataclasses.replace(mine, explore=_calibrate.save_ticket(root))
    return PrepareDecision.from_json(group.broadcast_json(mine.to_json() if mine else None))


def raise_if_failed(result: SaveResult) -> None:
    """Every rank, after recording the result: the same SaveError everywhere on a failed commit."""
    if result.outcome is not None and not result.outcome.ok:
        raise SaveError(f"checkpoint save failed, nothing committed: {result.outcome.error}")


def save_and_record(group: Group, root: Path, step: int, payload: Payload, reason: str, started: float,
                    blocking_s: float | None, sched: SaveScheduler) -> float | None:
    """Collective: `save_collective` (an explicit save may replace a committed step; an emergency
    one never calibrates), then rank 0 `record`s a save that wrote (its event carries
    `sched.interval_s` as of now), then every rank raises the same SaveError when it failed.
    Returns the save's cost for the scheduler (`blocking_s`, what training paid for an async
    save; else the seconds since `started`), or None when the step was already committed with
    this state."""
    result = save_collective(group, root, step, payload, replace_if_changed=reason == "explicit",
                             emergency=reason in EMERGENCY_REASONS)
    if result.skipped:
        return None
    seconds = time.perf_counter() - started
    if group.rank == 0:
        record(root, result, step, reason, seconds, world_size=group.world_size, blocking_s=blocking_s,
               interval_s=sched.interval_s)
    raise_if_failed(result)
    return blocking_s if blocking_s is not None else seconds


def after_commit(root: Path, rank: int, step: int, reason: str, retention: Any, mirror: Any) -> None:
    """Every rank, once step `step` is committed and recorded: rank 0 applies `retention` (not
    after an emergency save, see `apply_retention`) and hands the step to the mirror (only rank 0
    has one: a background upload, marker last). Never raises for retention."""
    if rank == 0 and retention is not None and reason not in EMERGENCY_REASONS:
        apply_retention(root, retention)
    if mirror is not None:
        mirror.enqueue(root, step)


@contextlib.contextmanager
def tolerated(on_save_error: str, sched: SaveScheduler) -> Iterator[None]:
    """Around a periodic save (or the surfacing of a background one's error): a SaveError is
    raised with on_save_error="raise", else logged, and the scheduler tries again after another
    interval; training goes on. Other exceptions pass through."""
    try:
        yield
    except SaveError as exc:
        if on_save_error == "raise":
            raise
        sched.failed()
        log.warning("%s; training continues without this checkpoint", exc)


def record(root: Path, result: SaveResult, step: int, reason: str, seconds: float, *, world_size: int,
           blocking_s: float | None, interval_s: float | None) -> None:
    """Rank 0, after a save that wrote: the log line and the `save_committed` event (its seconds
    and bytes feed `job.leadtime` and the auto save interval), or `save_failed`."""
    if result.outcome is None:
        return
    if not result.outcome.ok:
        try_append_event(root, EV_SAVE_FAILED, step=step, error=result.outcome.error, reason=reason)
        return
    log.info("saved step %d in %.2f s (%s, %s)", step, seconds, log_size(result.bytes), reason)
    if result.breakdown:
        log.debug("step %d save breakdown: %s", step, describe_breakdown(result.breakdown))
    try_append_event(root, EV_SAVE_COMMITTED, step=step, seconds=round(seconds, 4), reason=reason,
                     world_size=world_size, run_id=os.environ.get(ENV_RUN_ID),
                     blocking_s=None if blocking_s is None else round(blocking_s, 4), interval_s=interval_s,
                     bytes=result.bytes, writer=result.reports[0].writer if result.reports else None,
                     breakdown=result.breakdown)


def apply_retention(root: Path, retention: Any) -> None:
    """Rank 0, after a periodic or explicit commit (an emergency save leaves retention to the
    next run's first commit, so that it reaches its exit at once). A busy lock (a prune renaming)
    skips this round rather than stall training; a failure is logged, never raised."""
    from ..retention import apply_policy

    try:
        apply_policy(root, retention, lock_timeout=RETENTION_LOCK_WAIT_S)
    except Exception as exc:  # noqa: BLE001 - retention must never break training
        log.warning("retention after commit failed: %s", exc)

"""Retention: a pure plan of what to delete (`plan_prune`), and a small shell that deletes it.

Rules, each answering a failure seen elsewhere (PITFALLS.md, "Commits and retention"):
- Only complete checkpoints (marker + manifest + shard sizes) count toward `keep`; steps are
  compared as integers (steps 9, 10, 100 sort numerically, never as strings).
- Never deleted: the newest complete checkpoint, the best one by `keep_best`, every step that
  `keep_every` divides, a directory whose `.inprogress` writer may still run, and any incomplete
  directory that changed less than `young_threshold` seconds ago.
- Incomplete or corrupt directories are removed only when `remove_incomplete_older_than` is set,
  and only once idle for that long (and for `young_threshold`). A step this version cannot
  classify (written by a newer release, over a read cap, unreadable to this user) is neither:
  it is never deleted.
- Deletion is one rename (`commit.hide`) then rmtree, so a kill never leaves a directory
  that looks complete but misses files. The shell plans WITHOUT the root lock (a scan of
  thousands of directories must not hold up a commit), then takes the lock only for the
  renames, re-checking each victim just before its rename; the files are removed after the
  lock is released. The rules above keep it safe where that lock does nothing (NFS, Lustre
  `localflock`).
- A save's private `.saving.step_N.<token>/` directory (checkpoint/commit.py) left behind by a
  killed save is an incomplete record like any other: removed only when asked, once idle and
  its writer is not running.
"""

from __future__ import annotations

import errno
import logging
import math
import numbers
import os
import shutil
import stat
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from filelock import Timeout

from .checkpoint import leftovers as abandoned
from .checkpoint.commit import hide, root_lock
from .checkpoint.fsio import remove_tree
from .checkpoint.jsonenc import decode
from .checkpoint.layout import DELETING_PREFIX, LOCK, SAVING_PREFIX, saving_dirs
from .checkpoint.store import UNREADABLE, CheckpointInfo, inspect_dir, list_checkpoints, stat_sizes
from .duration import format_duration
from .errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    SlurmResumeError,
    UnsafeCheckpointError,
)

__all__ = ["RetentionPolicy", "CheckpointRecord", "Decision", "PrunePlan", "PruneResult",
           "plan_prune", "plan_checked", "metric_value", "best_record", "metric_names", "scan", "execute",
           "apply_policy", "clean_leftovers", "leftovers", "DEFAULT_YOUNG_THRESHOLD"]

log = logging.getLogger("slurmresume")

DEFAULT_YOUNG_THRESHOLD = 600.0


# A save directory with no `.inprogress` note that is younger than this is never deleted,
# whatever `young_threshold` says: its writer makes it, then writes the note into it
# (checkpoint/commit.py), without the root lock when that lock is stuck. A note naming a dead
# writer is proof enough and needs no floor.
SAVE_DIR_FLOOR_S = 60.0


@dataclass(frozen=True, kw_only=True)
class RetentionPolicy:
    """What to keep. Validated here, so a bad policy fails before anything is deleted."""

    keep: int
    """Keep the `keep` newest complete checkpoints (>= 1; the newest is kept regardless)."""
    keep_every: int | None = None
    """Also keep every complete step divisible by this (e.g. 1000), or None."""
    keep_best: str | None = None
    """Also keep the complete checkpoint with the best value of this metric, or None."""
    mode: str = "min"
    """"min" or "max": which value of `keep_best` is best."""
    remove_incomplete_older_than: float | None = None
    """Seconds; remove incomplete or corrupt directories idle this long. None: never remove."""
    young_threshold: float = DEFAULT_YOUNG_THRESHOLD
    """Seconds; an incomplete directory that changed more recently may be being written."""

    def __post_init__(self) -> None:
        if not _is_int(self.keep) or self.keep < 1:
            raise ConfigError(f"--keep must be an integer >= 1 (the newest checkpoint is always kept), "
                              f"got {self.keep!r}")
        if self.keep_every is not None and (not _is_int(self.keep_every) or self.keep_every < 1):
            raise ConfigError(f"--keep-every must be an integer >= 1, got {self.keep_every!r}")
        if self.keep_best is not None and (not isinstance(self.keep_best, str) or not self.keep_best.strip()):
            raise ConfigError(f"--keep-best must name a metric, got {self.keep_best!r}")
        if self.mode not in ("min", "max"):
            raise ConfigError(f"--mode must be 'min' or 'max', got {self.mode!r}")
        for what, v in (("--remove-incomplete-older-than", self.remove_incomplete_older_than),
                        ("young_threshold", self.young_threshold)):
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool)
                                  or not math.isfinite(v) or v < 0):
                raise ConfigError(f"{what} must be a duration >= 0 seconds, got {v!r}")


@dataclass(frozen=True)
class CheckpointRecord:
    """What the planner knows of one step directory; built by `scan`, or by hand in tests."""

    step: int
    name: str
    complete: bool  # marker, manifest and shard sizes all check out
    has_marker: bool = False  # marker present (with complete=False: corrupt)
    in_progress: bool = False  # `.inprogress` note whose writer may still be running
    mtime: float = 0.0  # last change of the directory or any entry in it (epoch seconds)
    metrics: Any = None  # decoded manifest metrics (complete checkpoints)
    unreadable: bool = False  # cannot be classified here (a newer format, over a read cap, no permission)
    unnoted_save: bool = False  # a `.saving.*` directory with no `.inprogress` note (yet)


@dataclass(frozen=True)
class Decision:
    record: CheckpointRecord
    delete: bool
    reasons: tuple[str, ...]  # why it is kept (all reasons), or why it goes


@dataclass(frozen=True)
class PrunePlan:
    decisions: tuple[Decision, ...]  # newest step first
    newest: CheckpointRecord | None  # newest complete
    best: CheckpointRecord | None  # best by policy.keep_best, if any checkpoint has the metric
    missing_metric: bool  # keep_best set, complete checkpoints exist, none has the metric

    @property
    def delete(self) -> tuple[CheckpointRecord, ...]:
        return tuple(d.record for d in self.decisions if d.delete)

    @property
    def keep(self) -> tuple[CheckpointRecord, ...]:
        return tuple(d.record for d in self.decisions if not d.delete)


def metric_value(metrics: Any, name: str) -> float | None:
    """The finite number under `name` (or a dotted path "eval.loss"), else None."""
    value = metrics.get(name) if isinstance(metrics, dict) else None
    if value is None and "." in name:
        value = metrics
        for part in name.split("."):
            value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None  # numbers.Real: NumPy scalars (np.float32 loss) count too
    return float(value)


def best_record(records: Iterable[CheckpointRecord], metric: str, mode: str) -> CheckpointRecord | None:
    """The complete record with the best finite `metric`; on a tie, the newest step."""
    sign = 1.0 if mode == "min" else -1.0
    scored = [(sign * v, -r.step, r.name, r) for r in records
              if r.complete and (v := metric_value(r.metrics, metric)) is not None]
    return min(scored, key=lambda t: t[:3])[3] if scored else None


def metric_names(records: Iterable[CheckpointRecord]) -> list[str]:
    """Numeric top-level metric names found in complete records (for error messages)."""
    return sorted({k for r in records if r.complete and isinstance(r.metrics, dict)
                   for k in r.metrics if metric_value(r.metrics, k) is not None})


def plan_prune(checkpoints: Sequence[CheckpointRecord], policy: RetentionPolicy, now: float) -> PrunePlan:
    """Pure: decide keep/delete for every record. No filesystem, no clock (`now` is given).

    Guarantees: the newest complete and the best survive; exactly the `policy.keep` newest
    complete survive plus those protected by `keep_every`/`keep_best`; incomplete records are
    never counted and only deleted per `_incomplete_reasons`. Re-planning the survivors with
    the same `now` deletes nothing more (idempotent).
    """
    complete = sorted((r for r in checkpoints if r.complete), key=lambda r: (r.step, r.name), reverse=True)
    newest = complete[0] if complete else None
    best = best_record(complete, policy.keep_best, policy.mode) if policy.keep_best else None
    decisions = []
    for i, r in enumerate(complete):
        reasons = _complete_reasons(r, i, policy, best)
        decisions.append(Decision(r, not reasons, reasons or (f"older than the {policy.keep} newest complete",)))
    for r in checkpoints:
        if not r.complete:
            delete, why = _incomplete_reasons(r, policy, now)
            decisions.append(Decision(r, delete, (why,)))
    decisions.sort(key=lambda d: (d.record.step, d.record.name), reverse=True)
    missing = bool(policy.keep_best) and bool(complete) and best is None
    return PrunePlan(tuple(decisions), newest, best, missing)


def _complete_reasons(r: CheckpointRecord, index: int, policy: RetentionPolicy,
                      best: CheckpointRecord | None) -> tuple[str, ...]:
    reasons = []
    if index == 0:
        reasons.append("newest complete")
    elif index < policy.keep:
        reasons.append(f"one of the {policy.keep} newest complete")
    if policy.keep_every and r.step % policy.keep_every == 0:
        reasons.append(f"step divisible by --keep-every {policy.keep_every}")
    if best is not None and policy.keep_best and r.name == best.name:
        reasons.append(f"best {policy.keep_best} ({policy.mode}: {metric_value(r.metrics, policy.keep_best)})")
    return tuple(reasons)


def _incomplete_reasons(r: CheckpointRecord, policy: RetentionPolicy, now: float) -> tuple[bool, str]:
    """(delete?, why) for a record that is not complete."""
    if r.unreadable:  # not corrupt, not incomplete: nothing here knows which, so it is never deleted
        return False, "unreadable by this version (or by this user): never deleted"
    label = "corrupt (marker but fails checks)" if r.has_marker else "incomplete (no marker)"
    idle = now - r.mtime
    limit = policy.remove_incomplete_older_than
    if r.in_progress:
        return False, f"{label}: being written (its .inprogress writer may still be running)"
    if r.unnoted_save and idle < SAVE_DIR_FLOOR_S:
        # made by a save that has not written its note yet (a save that found the lock stuck
        # goes on without it): no young_threshold, however small, may take it from its writer
        return False, f"{label}: a save directory {format_duration(idle)} old, its note may not be written yet"
    if idle < policy.young_threshold:
        return False, f"{label}: changed {format_duration(idle)} ago, may be being written"
    if limit is None:
        return False, f"{label}: not counted; --remove-incomplete-older-than removes it"
    if idle < limit:
        return False, f"{label}: idle {format_duration(idle)} < {format_duration(limit)}"
    return True, f"{label}: idle {format_duration(idle)} >= {format_duration(limit)}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# -- the imperative shell: filesystem facts, the lock, deletion --------------------------------


@dataclass
class PruneResult:
    plan: PrunePlan  # the plan made under the lock
    deleted: list[str] = field(default_factory=list)  # directory names removed
    skipped: list[tuple[str, str]] = field(default_factory=list)  # approved, but kept now: (name, why)
    cleaned: list[str] = field(default_factory=list)  # leftover .deleting.* entries removed


def scan(root: Path) -> list[CheckpointRecord]:
    """Records for every step directory under `root`, and for every save directory left behind
    (`.saving.*`, never complete: only a commit's rename makes a step). Never deletes."""
    records = [record_from_info(info) for info in list_checkpoints(Path(root), scan=True)]
    return records + [_record(Path(root), step, path.name) for step, path in saving_dirs(Path(root))]


def _record(root: Path, step: int, name: str) -> CheckpointRecord:
    """The record of one entry; a `.saving.*` directory is never complete (it is not a step)."""
    info = inspect_dir(step, root / name, scan=True)
    record = record_from_info(info)
    if name.startswith(SAVING_PREFIX) and record.complete:
        # marker written, not yet published: its note (kept in the record) still protects it
        record = replace(record, complete=False, mtime=abandoned.last_activity(root / name))
    if name.startswith(SAVING_PREFIX) and not info.in_progress:
        record = replace(record, unnoted_save=True)  # SAVE_DIR_FLOOR_S protects it
    return record


def record_from_info(info: CheckpointInfo) -> CheckpointRecord:
    """The planner's view of an inspected directory. Incomplete ones get their last activity
    (newest mtime of the directory and its entries: a streaming shard keeps it fresh). Every
    record keeps whether an `.inprogress` writer may still run, complete ones too: a save's
    private directory is whole before its publishing rename (see `_record`)."""
    busy = info.in_progress and not abandoned.writer_dead(info.path)  # the leftovers' one rule
    if info.complete:
        try:
            metrics = decode(info.metrics)
        except (SlurmResumeError, ValueError, TypeError, KeyError):  # odd metrics never block a prune
            metrics = None
        return CheckpointRecord(info.step, info.path.name, True, True, busy, info.mtime, metrics)
    return CheckpointRecord(info.step, info.path.name, False, info.has_marker, busy, abandoned.last_activity(info.path),
                            unreadable=info.unreadable)


def plan_checked(root: Path, records: Sequence[CheckpointRecord], policy: RetentionPolicy,
                 now: float) -> PrunePlan:
    """`plan_prune`, counting toward `keep` only steps whose shard sizes match their manifest.
    A scan judges a step by its marker alone, so a step whose shard was truncated since its commit
    would count and cost an older intact step. Whenever the plan deletes a complete step, each
    complete step it keeps is checked (its manifest read, each file lstat'ed: sizes, not
    checksums), once; a damaged one becomes a corrupt record (the rules for corrupt steps apply
    to it) or an unreadable one, and the plan is made again. Steps the plan only deletes are not
    checked: the cost follows what is kept (keep + keep_every + best), not the size of the root."""
    records = list(records)
    checked: set[str] = set()
    while True:
        plan = plan_prune(records, policy, now)
        todo = {r.name for r in plan.keep if r.complete} - checked if any(r.complete for r in plan.delete) else set()
        if not todo:
            return plan
        checked |= todo
        records = [_sized(root, r) if r.name in todo else r for r in records]


def _sized(root: Path, r: CheckpointRecord) -> CheckpointRecord:
    """The record of complete step `r` once its manifest is read and every file's size checked."""
    info = inspect_dir(r.step, root / r.name, sizes=False)
    if info.complete and info.manifest is not None:
        try:
            stat_sizes(info.path, info.manifest)
        except CorruptCheckpointError as exc:
            info.problem = str(exc)
        except PermissionError as exc:  # a directory that stopped being ours to search
            info.problem, info.unreadable = f"{UNREADABLE} ({exc.filename})", True
    return record_from_info(info)


@contextmanager
def locked(root: Path, timeout: float) -> Iterator[None]:
    """Hold the root's filelock. Refuses a lock path that is a link or not a regular file
    (filelock opens it O_NOFOLLOW too); a missing root is a ConfigError."""
    if not root.is_dir():
        raise ConfigError(f"checkpoint root {root} does not exist or is not a directory")
    path = root / LOCK
    _refuse_odd_lock(path)
    lock = root_lock(root, timeout)
    try:
        lock.acquire()
    except Timeout:
        raise CheckpointError(f"another process (a save or a prune) has held {path} for over {timeout:.0f} s: "
                              "retry later") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # swapped for a link after the check above
            raise UnsafeCheckpointError(f"lock file {path} is a symbolic link: refusing to prune; "
                                        f"inspect it, remove it (rm {path}) and retry") from None
        raise CheckpointError(f"cannot take the lock {path}: {exc.strerror}") from None
    try:
        yield
    finally:
        lock.release()


def _refuse_odd_lock(path: Path) -> None:
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise UnsafeCheckpointError(f"lock file {path} is a symbolic link or not a regular file: "
                                        f"refusing to prune; inspect it, remove it (rm {path}) and retry")
    except FileNotFoundError:
        pass


def execute(root: Path, policy: RetentionPolicy, approved: Collection[str] | None = None, *,
            lock_timeout: float = 30.0, now: float | None = None,
            progress: Callable[[int, int], None] | None = None) -> PruneResult:
    """Delete per `policy`. The plan is made WITHOUT the root lock (a scan can be slow; a commit
    must not wait behind it); then, under the lock and only for the renames, each victim that the
    plan deletes and `approved` allows (the names the user saw; None: all) is re-checked and
    renamed away; the files are removed, and leftover `.deleting.*` entries cleaned, after the
    lock is released. Raises CheckpointError (lock busy, lock not a plain file) before deleting
    anything, or naming what was deleted when a rename fails. One process only (rank 0)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"checkpoint root {root} does not exist or is not a directory")
    plan = plan_checked(root, scan(root), policy, time.time() if now is None else now)
    result = PruneResult(plan)
    chosen = {r.name for r in plan.delete}
    for name in sorted(set(approved or ()) - chosen):
        result.skipped.append((name, "kept by the plan"))
    victims = [r for r in plan.delete if approved is None or r.name in approved]
    hidden: list[Path] = []
    with locked(root, lock_timeout):
        for i, r in enumerate(victims, 1):
            if progress is not None:
                progress(i, len(victims))
            why = _still_deletable(root, r, plan, policy, now)
            if why is not None:
                result.skipped.append((r.name, why))
                continue
            try:
                hidden.append(hide(root / r.name, "prune"))
            except FileNotFoundError:  # gone since the plan (a save published it): nothing to do
                result.skipped.append((r.name, "vanished since the plan"))
                continue
            except OSError as exc:
                done = f" after deleting {', '.join(result.deleted)}" if result.deleted else ""
                raise CheckpointError(f"cannot delete {root / r.name}: {exc.strerror}{done}; "
                                      "the rest is untouched") from None
            result.deleted.append(r.name)
    for path in hidden:
        shutil.rmtree(path, ignore_errors=True)
    result.cleaned = clean_leftovers(root) + abandoned.clean(root, policy.young_threshold)
    return result


def _still_deletable(root: Path, r: CheckpointRecord, plan: PrunePlan, policy: RetentionPolicy,
                     now: float | None) -> str | None:
    """None when `r` may go now (called under the lock, right before its rename); else why not.
    A complete victim goes only while the plan's newest (and best) are still complete: another
    prune or a user may have removed them since the plan was made. Incomplete directories are
    looked at again: a writer may have started or resumed in one since the scan."""
    if r.complete:
        for keeper in (plan.newest, plan.best):
            if keeper is not None and not inspect_dir(keeper.step, root / keeper.name, scan=True).complete:
                return f"{keeper.name}, kept by the plan, is no longer complete: run prune again"
        return None  # committed directories never change, and newer ones only add protection
    if not os.path.lexists(root / r.name):
        return "removed since the plan was made"
    fresh = _record(root, r.step, r.name)
    if fresh.complete:
        return "committed since the plan was made"
    delete, why = _incomplete_reasons(fresh, policy, time.time() if now is None else now)
    return None if delete else why


def clean_leftovers(root: Path) -> list[str]:
    """Remove `.deleting.*` entries left by a killed deletion (already invisible to readers).
    A link is unlinked, never followed. Returns the names this call removed, entirely: not one
    that could not be removed, nor one another process removed or took meanwhile."""
    return [name for name in leftovers(root) if remove_tree(root / name)]


def leftovers(root: Path) -> list[str]:
    """Names of `.deleting.*` entries under `root` (partial deletions; nothing reads them)."""
    try:
        with os.scandir(root) as it:
            return sorted(e.name for e in it if e.name.startswith(DELETING_PREFIX))
    except FileNotFoundError:
        return []


def apply_policy(root: Path, policy: RetentionPolicy, *, lock_timeout: float = 10.0) -> PruneResult:
    """Library entry point, called by `Checkpointer` on rank 0 after each commit: deletes per
    `policy` without asking. A metric no checkpoint records yet only logs a warning."""
    if not isinstance(policy, RetentionPolicy):
        raise ConfigError(f"retention must be a slurmresume.retention.RetentionPolicy, got {type(policy).__name__}")
    result = execute(Path(root), policy, lock_timeout=lock_timeout)
    if result.plan.missing_metric:
        log.warning("retention: no complete checkpoint records metric %r yet; keeping by --keep only",
                    policy.keep_best)
    for name in result.deleted:
        log.info("retention: deleted %s", Path(root) / name)
    return result

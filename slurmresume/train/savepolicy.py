"""When to save: a `SavePolicy` (what the user asks for), a `SaveScheduler` (the per-run state
that answers "is this step due?"), and the pure numbers behind `interval="auto"`.

The model (Young 1974, Daly 2006). A run that saves every T seconds of work, each save costing
C seconds, and is hit by an unwarned failure every M seconds on average (mean time between
failures), loses about

    C / T          of its time to saving, plus
    T / (2 M)      to recomputing work since the last save (a failure lands mid-interval),

so the expected loss fraction is C/T + T/(2M), smallest at T* = sqrt(2 C M). Preemptions
that come with a warning signal cost no recomputation (the agreed-step save keeps the work),
so only *unwarned* interruptions count towards M. First-order: valid while C << T << M;
restart and queue time are left out (they do not depend on T).

Call order (every rank, same order; only the decision of one rank may count, see `due`):
    sched = SaveScheduler(policy, history=estimate_from_events(read_events(root)))
    sched.restored(step)                      # after a restore, when there was one
    each step: if sched.due(step, epoch_end=...): save ...; sched.saved(step, seconds)
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError
from ..events import (
    EV_EXIT_AFTER_SAVE,
    EV_FAILED,
    EV_FINISHED,
    EV_GAVE_UP,
    EV_RESTORED,
    EV_RUN_ENDED,
    EV_SAVE_COMMITTED,
    EV_SAVE_FAILED,
    EV_SIGNAL_AGREED,
    EV_STARTED,
    EV_STOPPED,
    EV_SUBMITTED,
    save_seconds,
)

__all__ = ["SavePolicy", "SaveScheduler", "Estimate", "IntervalSummary", "young_daly", "auto_interval",
           "expected_loss_fraction", "loss_fractions", "estimate_from_events", "interval_summary"]

RECENT_SAVES = 16  # the save cost C is the median of this many most recent saves


def _positive(name: str, value: Any, *, integer: bool = False) -> None:
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value <= 0:
        what = "a positive integer" if integer else "a positive number of seconds"
        raise ConfigError(f"SavePolicy({name}=...) must be {what} or None, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class SavePolicy:
    """When periodic saves happen; any combination of triggers may be set (none: only the
    warning signal and explicit `save()` calls save). A step is never saved twice.

    Fields:
        every_steps: save when `step % every_steps == 0`.
        every_seconds: save when this many seconds of wall time have passed since the end of
            the previous save (or since the run started).
        at_epoch_end: save when the training loop reports an epoch end.
        interval: "auto" adapts the seconds interval to Young/Daly T* = sqrt(2*C*MTBF) from
            the measured save cost and the observed unwarned-failure rate; excludes
            every_seconds.
        min_seconds, max_seconds: the bounds of the "auto" interval.
    """

    every_steps: int | None = None
    every_seconds: float | None = None
    at_epoch_end: bool = False
    interval: Literal["auto"] | None = None
    min_seconds: float = 60
    max_seconds: float = 3600

    def __post_init__(self) -> None:
        if self.every_steps is not None:
            _positive("every_steps", self.every_steps, integer=True)
        if self.every_seconds is not None:
            _positive("every_seconds", self.every_seconds)
        if not isinstance(self.at_epoch_end, bool):
            raise ConfigError(f"SavePolicy(at_epoch_end=...) must be True or False, got {self.at_epoch_end!r}")
        if self.interval not in ("auto", None):
            raise ConfigError(f"SavePolicy(interval=...) must be 'auto' or None, got {self.interval!r}")
        if self.interval == "auto" and self.every_seconds is not None:
            raise ConfigError("SavePolicy: give every_seconds or interval='auto', not both "
                              "(auto chooses the seconds interval itself, within min_seconds..max_seconds)")
        _positive("min_seconds", self.min_seconds)
        _positive("max_seconds", self.max_seconds)
        if self.min_seconds > self.max_seconds:
            raise ConfigError(f"SavePolicy: min_seconds ({self.min_seconds}) is more than max_seconds "
                              f"({self.max_seconds}): swap them or widen the range")


# -- the pure numbers -----------------------------------------------------------------------------

def young_daly(save_cost_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal seconds of work between saves: T* = sqrt(2 * C * MTBF)."""
    return math.sqrt(2.0 * save_cost_s * mtbf_s)


def loss_fractions(interval_s: float, save_cost_s: float, mtbf_s: float | None) -> tuple[float, float]:
    """(C/T, T/(2*MTBF)): expected fraction of time spent saving, and lost to recomputing work
    after unwarned failures. An MTBF of None (no failure seen) gives 0 for the second."""
    saves = save_cost_s / interval_s
    failures = interval_s / (2.0 * mtbf_s) if mtbf_s else 0.0
    return saves, failures


def expected_loss_fraction(interval_s: float, save_cost_s: float, mtbf_s: float) -> float:
    """C/T + T/(2*MTBF): the first-order expected fraction of time lost; minimal at `young_daly`."""
    return sum(loss_fractions(interval_s, save_cost_s, mtbf_s))


def auto_interval(policy: SavePolicy, save_cost_s: float | None, mtbf_s: float | None,
                  runtime_s: float) -> float:
    """The "auto" interval: young_daly(C, MTBF) clamped to [min_seconds, max_seconds].

    Before any save was measured, min_seconds (save early to learn C). With no unwarned
    failure seen yet, MTBF is taken as the runtime observed so far, a lower bound: the
    interval starts short and grows only as the job proves stable."""
    if save_cost_s is None:
        return policy.min_seconds
    mtbf = mtbf_s if mtbf_s is not None else runtime_s
    t = young_daly(max(save_cost_s, 0.0), max(mtbf, 0.0))
    return min(policy.max_seconds, max(policy.min_seconds, t))


# -- the scheduler ----------------------------------------------------------------------------

class SaveScheduler:
    """Per-run state for one `SavePolicy`. `clock` is the seam for time (monotonic seconds).

    Step and epoch triggers are deterministic, so every rank decides alike; a seconds or
    "auto" trigger reads the local clock, so for a collective save only one rank's
    `trigger() == "seconds"` may count (rank 0's, shared at the step-boundary agreement).
    Every rank then calls `saved()` for the step all of them saved.
    """

    def __init__(self, policy: SavePolicy, clock: Callable[[], float] = time.monotonic, *,
                 history: Estimate | None = None) -> None:
        self.policy = policy
        self.clock = clock
        self.history = history or Estimate()
        self._started = self._last_save_end = clock()
        self._saved: set[int] = set()
        self._costs: deque[float] = deque(maxlen=RECENT_SAVES)

    @property
    def save_cost_s(self) -> float | None:
        """Median of this run's recent save times, else the event log's estimate."""
        return statistics.median(self._costs) if self._costs else self.history.save_cost_s

    @property
    def interval_s(self) -> float | None:
        """The seconds interval in force now (None: no time trigger)."""
        p = self.policy
        if p.interval != "auto":
            return p.every_seconds
        runtime = self.history.runtime_s + (self.clock() - self._started)
        n = self.history.interruptions
        return auto_interval(p, self.save_cost_s, runtime / n if n else None, runtime)

    def due(self, step: int, *, epoch_end: bool = False) -> bool:
        """Whether `step` should be saved now: on a multiple of every_steps, at an epoch end
        when asked, or once the seconds interval has passed. Never for a step already saved."""
        return self.trigger(step, epoch_end=epoch_end) is not None

    def trigger(self, step: int, *, epoch_end: bool = False) -> Literal["steps", "epoch", "seconds"] | None:
        """Which trigger makes `step` due (steps and epoch first: they are the same on every
        rank; "seconds" reads this process's clock), or None when it is not due."""
        if step in self._saved:
            return None
        p = self.policy
        if p.every_steps and step % p.every_steps == 0:
            return "steps"
        if epoch_end and p.at_epoch_end:
            return "epoch"
        interval = self.interval_s
        return "seconds" if interval is not None and self.clock() - self._last_save_end >= interval else None

    def saved(self, step: int, seconds_taken: float) -> None:
        """Record a committed save of `step` that took `seconds_taken`; restarts the timer."""
        self._saved.add(step)
        if math.isfinite(seconds_taken) and seconds_taken >= 0:
            self._costs.append(float(seconds_taken))
        self._last_save_end = self.clock()

    def started(self, step: int) -> None:
        """An (async) save of `step` has begun: not due again, and the seconds timer restarts
        now, so no step is due by the clock while its write runs; `saved()` follows on commit."""
        self._saved.add(step)
        self._last_save_end = self.clock()

    def failed(self) -> None:
        """A due save failed (and the run goes on): try again after another interval, not at
        every step."""
        self._last_save_end = self.clock()

    def restored(self, step: int) -> None:
        """Record that `step` is on disk already (restored from it): not due again."""
        self._saved.add(step)


# -- what the event log says --------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    """What the event log says about a job.

    save_cost_s: median seconds of the most recent committed saves (None: none yet).
    step_s: seconds per training step between saves, save time excluded (None: unknown).
    mtbf_s: runtime_s / interruptions (None: no unwarned interruption seen).
    interruptions: runs that failed, or were killed (a later run started and this one
        left no end record); warned preemptions are not counted: they saved.
    runtime_s: the runs' summed running time, first to last event of each.
    """

    save_cost_s: float | None = None
    step_s: float | None = None
    mtbf_s: float | None = None
    interruptions: int = 0
    runtime_s: float = 0.0


_WORKER_EVENTS = {EV_SAVE_COMMITTED, EV_SAVE_FAILED, EV_RESTORED, EV_SIGNAL_AGREED, EV_EXIT_AFTER_SAVE}


@dataclass
class _Run:
    key: str | None
    events: list[dict[str, Any]] = field(default_factory=list)

    def outcome(self) -> str | None:
        """One of failed, warned, finished; None when the run left no end record."""
        kinds = {e["event"]: e for e in self.events}
        if EV_RUN_ENDED in kinds:
            out = kinds[EV_RUN_ENDED].get("outcome")
            return "failed" if out == "failed" else "finished" if out == "finished" else "warned"
        if EV_FAILED in kinds:
            return "failed"
        if EV_EXIT_AFTER_SAVE in kinds:
            return "warned"
        return "finished" if kinds.keys() & {EV_FINISHED, EV_GAVE_UP, EV_STOPPED} else None


def _run_key(e: dict[str, Any]) -> str | None:
    if e.get("run_id"):
        return str(e["run_id"])
    if e["event"] in _WORKER_EVENTS:  # a bare Checkpointer, no launcher: one process, one run
        return f"pid:{e.get('host')}:{e.get('pid')}"
    return None


def split_runs(events: Iterable[dict[str, Any]]) -> list[_Run]:
    """Group events into runs: a run is one `started` run_id (every node's launcher logs it),
    or one process when no launcher logged anything. Events without a run id (requeued,
    failed, finished from the launcher) belong to the run that is current; a `submitted`
    (a new job on this root) ends it, so the time until the next run counts for none."""
    runs: list[_Run] = []
    by_key: dict[str, _Run] = {}
    cur: _Run | None = None
    for e in events:
        key = _run_key(e)
        if key is not None and key in by_key:
            by_key[key].events.append(e)
            continue
        if e["event"] == EV_SUBMITTED:
            cur = None
            continue
        if e["event"] == EV_STARTED or (key is not None and (cur is None or cur.key is not None)):
            cur = _Run(key)
            runs.append(cur)
        elif cur is None:  # not part of any run
            continue
        elif key is not None:  # a started without run id, then its workers' events
            cur.key = key
        if key is not None:
            by_key[key] = cur
        cur.events.append(e)
    return runs


def _time(e: dict[str, Any]) -> float:
    t = e.get("time")
    return float(t) if isinstance(t, (int, float)) and math.isfinite(t) else math.nan


def _seconds_per_step(runs: list[_Run]) -> float | None:
    """Training seconds per step between consecutive saves (or a restore and a save) of a run:
    sum of (gap - later save's seconds) over sum of step deltas."""
    work = steps = 0.0
    for run in runs:
        prev: dict[str, Any] | None = None
        for e in run.events:
            if e["event"] not in (EV_SAVE_COMMITTED, EV_RESTORED) or not isinstance(e.get("step"), int):
                continue
            if prev is not None and e["step"] > prev["step"]:
                dt = _time(e) - _time(prev) - float(e.get("seconds") or 0)
                if dt > 0:
                    work, steps = work + dt, steps + e["step"] - prev["step"]
            prev = e
    return work / steps if steps else None


def estimate_from_events(events: list[dict[str, Any]]) -> Estimate:
    """Pure: the save cost, step time, runtime and unwarned interruptions in an event log
    (oldest first, as `events.read_events` returns it). See `Estimate` for each field."""
    costs = save_seconds(events)
    runs = split_runs(events)
    interruptions = 0
    runtime = 0.0
    for i, run in enumerate(runs):
        outcome = run.outcome()
        if outcome == "failed" or (outcome is None and i < len(runs) - 1):
            interruptions += 1
        times = [t for t in map(_time, run.events) if not math.isnan(t)]
        runtime += max(times) - min(times) if times else 0.0
    return Estimate(
        save_cost_s=statistics.median(costs[-RECENT_SAVES:]) if costs else None,
        step_s=_seconds_per_step(runs),
        mtbf_s=runtime / interruptions if interruptions else None,
        interruptions=interruptions,
        runtime_s=runtime,
    )


# -- for `status` ----------------------------------------------------------------------------

@dataclass
class IntervalSummary:
    """The save-interval section of `slurmresume status` (see the schema in status.py)."""

    current_s: float | None
    source: str | None
    auto_s: float | None
    young_daly_s: float | None
    min_s: float
    max_s: float
    save_cost_s: float | None
    saves: int
    steps_per_second: float | None
    runtime_s: float
    interruptions: int
    failures_per_hour: float | None
    mtbf_s: float | None
    expected_loss: dict[str, Any] | None


def _observed_interval(runs: list[_Run]) -> float | None:
    """Median seconds of work between consecutive saves of a run, where the later one was a
    periodic save (gap minus that save's own seconds)."""
    gaps = []
    for run in runs:
        saves = [e for e in run.events if e["event"] == EV_SAVE_COMMITTED]
        for a, b in pairwise(saves):
            if b.get("reason") == "periodic":
                gap = _time(b) - _time(a) - float(b.get("seconds") or 0)
                if gap > 0:
                    gaps.append(gap)
    return statistics.median(gaps) if gaps else None


def interval_summary(events: list[dict[str, Any]], policy: SavePolicy | None = None) -> IntervalSummary:
    """Pure: the interval in force (as logged in `interval_s` of the newest save, else as
    observed), what "auto" would choose (bounds of `policy`, default SavePolicy's), and the
    expected loss at the current interval (else at the auto one)."""
    policy = policy or SavePolicy(interval="auto")
    est = estimate_from_events(events)
    saves = [e for e in events if e["event"] == EV_SAVE_COMMITTED]
    logged = next((e["interval_s"] for e in reversed(saves) if isinstance(e.get("interval_s"), (int, float))), None)
    current, source = (float(logged), "logged") if logged is not None else (_observed_interval(split_runs(events)),
                                                                            "observed")
    auto = auto_interval(policy, est.save_cost_s, est.mtbf_s, est.runtime_s) if est.save_cost_s is not None else None
    loss = None
    t = current or auto
    if t and est.save_cost_s is not None:
        s, f = loss_fractions(t, est.save_cost_s, est.mtbf_s)
        loss = {"interval_s": t, "saves": s, "failures": f if est.mtbf_s else None,
                "total": s + f if est.mtbf_s else None}
    return IntervalSummary(
        current_s=current, source=source if current is not None else None, auto_s=auto,
        young_daly_s=young_daly(est.save_cost_s, est.mtbf_s) if est.save_cost_s is not None and est.mtbf_s else None,
        min_s=policy.min_seconds, max_s=policy.max_seconds, save_cost_s=est.save_cost_s, saves=len(saves),
        steps_per_second=1.0 / est.step_s if est.step_s else None, runtime_s=est.runtime_s,
        interruptions=est.interruptions,
        failures_per_hour=est.interruptions / (est.runtime_s / 3600) if est.runtime_s > 0 else None,
        mtbf_s=est.mtbf_s, expected_loss=loss)


def scheduler_for(policy: SavePolicy | None, save_every: int | None, root: Path) -> SaveScheduler:
    """`Checkpointer`'s scheduler: `policy`, or every `save_every` steps; interval="auto" starts
    from the save costs and failures already in the root's event log."""
    from ..events import read_events

    policy = policy or SavePolicy(every_steps=save_every)
    return SaveScheduler(policy, history=estimate_from_events(read_events(root)) if policy.interval == "auto" else None)

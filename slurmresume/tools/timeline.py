"""What a run's event log says about its runs and interruptions: pure, no plotting.

`build_timeline(events)` turns the event log into runs, each a list of (time, step) commits
plus its warnings and what ended it. `preemption_cost(events)` says what each requeue or
failure cost: its down time, measured from the event log's timestamps (the first warning event
of a run, `signal_forwarded` / `signal_agreed`, or the end of a failed run (the death itself where
the restart's `resumed` event gives the launcher's clock of it), to the next run's first step: the launcher's `resumed` event, else its `restored` event, else its first commit),
the work the next run had to redo (for a failure, a hang or a warning whose save failed: the
seconds and steps since the last commit), their totals and their share of the wall time.
`status` shows it in its headline and --json; `status --plot` (plot.py) draws it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..events import (
    EV_EMERGENCY_SAVE_FAILED,
    EV_FAILED,
    EV_FINISHED,
    EV_GAVE_UP,
    EV_HANG,
    EV_HELD,
    EV_INTERRUPTED,
    EV_NO_CHECKPOINT,
    EV_REQUEUE_FAILED,
    EV_REQUEUED,
    EV_RESTORED,
    EV_RESUMED,
    EV_RUN_ENDED,
    EV_SAVE_COMMITTED,
    EV_SIGNAL_AGREED,
    EV_SIGNAL_FORWARDED,
    EV_STARTED,
    EV_STOPPED,
)

END_FAILED = {EV_FAILED, EV_GAVE_UP, EV_REQUEUE_FAILED, EV_INTERRUPTED, EV_NO_CHECKPOINT}
# The launcher will not restart the job after these: a later run is a new submission, and the time
# between is neither down time nor the job's wall time.
TERMINAL = {EV_GAVE_UP, EV_REQUEUE_FAILED, EV_INTERRUPTED, EV_NO_CHECKPOINT, EV_STOPPED, EV_HELD, EV_FINISHED}


@dataclass
class Run:
    start: float
    start_step: int
    points: list[tuple[float, int]] = field(default_factory=list)  # committed saves (time, step)
    warnings: list[tuple[float, int]] = field(default_factory=list)
    end: float | None = None
    end_kind: str = ""  # "preempt" | "failed" | "hang" | "finished" | "stopped" | "" (still running)
    lost_s: float = 0.0  # work redone by the next run: end - last commit
    lost_steps: int = 0
    lost_estimated: bool = False  # lost_steps from the rate (no event names the step the run reached)
    reached: int | None = None  # the furthest step any event of this run names
    reached_logged: bool = False  # the launcher logged how far the ranks got (run_ended.last_step)
    run_id: str | None = None  # the launcher's (its `started` event)
    failure_at: float | None = None  # a restart's: when the previous run's failure was seen (launcher's clock)
    resumed_at: float | None = None  # this run's first step (a restart's end of down time)
    resumed_exact: bool = False  # resumed_at is from the launcher's `resumed` event, not a proxy
    save_failed: bool = False  # warned, but the emergency save did not commit
    terminal: bool = False  # the launcher gave up (or finished): nothing restarts it

    @property
    def last(self) -> tuple[float, int]:
        return self.points[-1] if self.points else (self.start, self.start_step)


@dataclass
class Timeline:
    t0: float
    runs: list[Run]
    requeues: list[float]
    t_end: float = 0.0  # the newest event

    def rate(self) -> float | None:
        """Steps per second over all runs' commits (to estimate the steps lost after the last)."""
        num = den = 0.0
        for r in self.runs:
            pts = [(r.start, r.start_step), *r.points]
            if len(pts) >= 2 and pts[-1][0] > pts[0][0]:
                num += pts[-1][1] - pts[0][1]
                den += pts[-1][0] - pts[0][0]
        return num / den if den > 0 and num > 0 else None


def _t(e: dict[str, Any]) -> float | None:
    t = e.get("time")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def build_timeline(events: list[dict[str, Any]]) -> Timeline:
    """Pure: the runs in an event log (oldest first), each with its saves, warnings and end."""
    events = [e for e in events if _t(e) is not None]
    if not events:
        return Timeline(0.0, [], [])
    runs: list[Run] = []
    requeues: list[float] = []
    cur: Run | None = None
    for e in events:
        t, kind = _t(e) or 0.0, e.get("event")
        step = e.get("step") if isinstance(e.get("step"), int) else None
        if kind == EV_RUN_ENDED and isinstance(e.get("last_step"), int) and cur is not None \
                and e.get("run_id") in (None, cur.run_id):  # another node's word on the run before: not ours
            step = e["last_step"]  # the launcher's: the furthest step its ranks' heartbeats reported
            cur.reached_logged = True
        if kind == EV_STARTED and e.get("node") not in (None, 0):
            continue  # every node's launcher logs its start: the first node's is the run's
        if kind == EV_STARTED:
            cur = Run(t, runs[-1].last[1] if runs and runs[-1].end_kind != "failed" else _restart_step(runs))
            cur.run_id = e.get("run_id") if isinstance(e.get("run_id"), str) else None
            runs.append(cur)
        elif cur is None:
            if kind == EV_SAVE_COMMITTED and step is not None:  # a library-only run: no launcher events
                cur = Run(t, 0)
                runs.append(cur)
            else:
                continue
        if step is not None and kind not in (EV_RESTORED, EV_RESUMED) and (cur.reached is None or step > cur.reached):
            cur.reached = step
        if kind == EV_RESTORED and step is not None:
            cur.start_step = step
            cur.resumed_at = cur.resumed_at or t
        elif kind == EV_RESUMED:  # one per node: the first node to step again ends the down time
            at = e.get("first_step_at")
            at = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else t
            cur.resumed_at = min(at, cur.resumed_at) if cur.resumed_exact and cur.resumed_at else at
            cur.resumed_exact = True
            secs = e.get("seconds")
            if e.get("cause") in ("failure", "hang") and isinstance(secs, (int, float)) and not isinstance(secs, bool):
                died = at - secs  # the launcher's clock of the death (or the hang's kill) it restarted after
                cur.failure_at = min(died, cur.failure_at) if cur.failure_at is not None else died
        elif kind == EV_EMERGENCY_SAVE_FAILED:
            cur.save_failed = True
        elif kind == EV_SAVE_COMMITTED and step is not None:
            cur.points.append((t, step))
            cur.resumed_at = cur.resumed_at or t
        elif kind in (EV_SIGNAL_AGREED, EV_SIGNAL_FORWARDED):
            _warning(cur, t, step)
        if kind in TERMINAL:  # what ended the run (above: what happened in it)
            cur.terminal = True
        if kind == EV_REQUEUED:
            requeues.append(t)
            _end(cur, t, "preempt")
        elif kind in END_FAILED or (kind == EV_RUN_ENDED and e.get("outcome") == "failed"):
            _end(cur, t, "failed")
        elif isinstance(kind, str) and kind.startswith(EV_HANG):
            _end(cur, t, "hang")
        elif kind == EV_FINISHED:
            _end(cur, t, "finished")
        elif kind == EV_STOPPED:
            _end(cur, t, "stopped")
    tl = Timeline(_t(events[0]) or 0.0, runs, requeues, max(_t(e) or 0.0 for e in events))
    _place_warnings(tl)
    return tl


WARNING_BURST_S = 5.0  # the launcher's relay and the ranks' agreement on one warning: one triangle


def _warning(run: Run, t: float, step: int | None) -> None:
    """A warning arrived at `t`; the ranks' agreed step (when logged) is where it is drawn. The
    launcher's relay (no step) comes first, the agreement a moment later: one warning."""
    if run.warnings and t - run.warnings[-1][0] < WARNING_BURST_S:
        if step is not None:
            run.warnings[-1] = (run.warnings[-1][0], step)
        return
    run.warnings.append((t, step if step is not None else -1))


def _place_warnings(tl: Timeline) -> None:
    """A warning no rank agreed on (the run died first) is drawn where the run's speed puts it."""
    rate = tl.rate()
    for r in tl.runs:
        t_c, s_c = r.last
        r.warnings = [(t, s if s >= 0 else s_c + int(max(0.0, t - t_c) * (rate or 0))) for t, s in r.warnings]


def _restart_step(runs: list[Run]) -> int:
    """A run after a failure restarts from the newest commit before it."""
    return max((r.last[1] for r in runs if r.points), default=0)


def _end(run: Run, t: float, kind: str) -> None:
    if run.end is None or kind == "failed":
        run.end, run.end_kind = t, kind


def mark_lost(tl: Timeline) -> None:
    """Work the next run redid: from the last commit to the end of a run no save covered (a
    failure, a hang, a warning whose save failed), or to the death itself when the launcher logged
    it (a failure save commits after the death: nothing lost). Steps are the furthest step the
    launcher or an event of the run names, else estimated from the speed."""
    rate = tl.rate()
    for i, r in enumerate(tl.runs):
        if r.end is not None and (r.end_kind in ("failed", "hang") or r.save_failed):
            nxt = tl.runs[i + 1] if i + 1 < len(tl.runs) and not r.terminal else None
            end = min(r.end, nxt.failure_at) if nxt is not None and nxt.failure_at is not None else r.end
            r.lost_s = max(0.0, end - r.last[0])
            if r.reached is not None and (r.reached > r.last[1] or r.reached_logged):
                r.lost_steps = max(0, r.reached - r.last[1])
            else:
                r.lost_steps, r.lost_estimated = (int(r.lost_s * rate), True) if rate else (0, False)


@dataclass
class Interruption:
    """One requeue or failure: when the run stopped working, when the next one stepped again."""

    kind: str  # "preempt" | "failed" | "hang"
    at: float  # the warning (preempt), else the end of the run
    step: int  # where: the warning's step, else the newest commit
    resumed_at: float | None  # the next run's first step (None: not resumed yet)
    down_s: float | None  # resumed_at - at
    lost_s: float  # work redone: seconds since the last commit (0 when the warned save committed)
    lost_steps: int
    lost_estimated: bool  # lost_steps estimated from the speed
    ongoing: bool = False  # not resumed yet: down_s runs to `now`


@dataclass
class Cost:
    """What interruptions cost a run (`preemption_cost`); seconds, from the event log's clock."""

    interruptions: list[Interruption]
    down_s: float  # the sum of the measured down times
    lost_s: float  # the sum of the work redone
    wall_s: float  # the first run's start to the newest event (or to `now` while running)

    @property
    def fraction(self) -> float | None:
        """(down + lost) / wall time: the share of the run's wall time interruptions took."""
        return (self.down_s + self.lost_s) / self.wall_s if self.wall_s > 0 else None

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {**asdict(self), "fraction": self.fraction}


def interruptions(tl: Timeline, now: float | None = None) -> list[Interruption]:
    """Pure: every run that ended in a requeue, a failure or a hang. One the newest run has not
    recovered from yet (requeued, or restarted but not stepping) is down until `now` (ongoing);
    a failure nothing restarted (gave up) has no down time."""
    out = []
    for i, r in enumerate(tl.runs):
        if r.end is None or r.end_kind not in ("preempt", "failed", "hang"):
            continue
        nxt = tl.runs[i + 1] if i + 1 < len(tl.runs) else None
        warned = r.end_kind == "preempt" and bool(r.warnings)
        at, step = (r.warnings[0] if warned else (r.end, r.last[1]))
        if not warned and nxt is not None and nxt.failure_at is not None and not r.terminal:
            at = min(at, nxt.failure_at)  # the death itself, before the survivors' save and the exit
        resumed = nxt.resumed_at if nxt is not None and not r.terminal else None
        waiting = not r.terminal and resumed is None and now is not None and (
            (nxt is None and r.end_kind == "preempt") or (nxt is not None and nxt is tl.runs[-1] and nxt.end is None))
        down = max(0.0, resumed - at) if resumed is not None else max(0.0, now - at) if waiting and now else None
        out.append(Interruption(r.end_kind, at, step, resumed, down, r.lost_s, r.lost_steps, r.lost_estimated,
                                ongoing=waiting))
    return out


def preemption_cost(events: list[dict[str, Any]], now: float | None = None) -> Cost | None:
    """Pure: the down time and lost work of every interruption in the log, their totals and the
    wall time they are a share of; None when no run was interrupted."""
    tl = build_timeline(events)
    mark_lost(tl)
    return cost_of(tl, now)


def cost_of(tl: Timeline, now: float | None) -> Cost | None:
    found = interruptions(tl, now)
    if not found:
        return None
    live = tl.runs[-1].end is None or found[-1].ongoing
    end = max(tl.t_end, now) if live and now is not None else tl.t_end
    idle = sum(max(0.0, nxt.start - r.end) for r, nxt in zip(tl.runs, tl.runs[1:], strict=False)
               if r.terminal and r.end is not None)  # given up, then resubmitted by hand
    return Cost(found, sum(i.down_s or 0.0 for i in found), sum(i.lost_s for i in found),
                max(0.0, end - tl.runs[0].start - idle))


def cost_line(cost: Cost) -> str:
    """'down 13.9s + 9.4s + 7.3s, work lost 0s: 64% of 48.0s wall time' (plot title, status headline)."""
    downs = [secs(i.down_s) + (" (still down)" if i.ongoing else "") for i in cost.interruptions
             if i.down_s is not None]
    down = " + ".join(downs) if 1 <= len(downs) <= 4 else secs(cost.down_s)
    steps = sum(i.lost_steps for i in cost.interruptions)
    approx = "~" if any(i.lost_estimated for i in cost.interruptions) else ""
    lost = secs(cost.lost_s) + (f" ({approx}{steps} steps)" if steps else "")
    share = f": {cost.fraction:.0%} of {secs(cost.wall_s)} wall time" if cost.fraction is not None else ""
    return f"down {down}, work lost {lost}{share}"


def secs(s: float) -> str:
    """Seconds with one decimal under a minute (a restart takes seconds), else as elsewhere."""
    if s < 60:
        return f"{s:.1f}s"
    from ..duration import format_duration

    return format_duration(s)

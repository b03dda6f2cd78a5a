"""What each unwarned failure of a root cost, read from its event log (pure, no printing).

`unwarned_failures(events)` finds every run that ended without warning (a rank died or hung:
the launcher's `run_ended` with outcome "failed" or "hung"; or, with no launcher, the survivors'
`failure_save`) and says, for each:
- where it happened: the survivors' step boundary (the `failure_save` event's step), else the
  last step boundary the dead ranks' heartbeats reported (the launcher's `run_ended.dead_steps`),
  else the furthest step any rank reported (`run_ended.last_step`, the hang's step);
- the failure save: committed (its step, writer, seconds), refused (the pieces no survivor
  covered), failed (the write's error), or none (no survivor saved: the guard was not active,
  the run was unwatched, the whole node died...);
- what the next run resumed from (its `restored` step; 0 when it stepped without restoring),
  the steps repeated (the furthest step trained before the failure minus that), and the
  seconds from the failure to the first resumed step (the launcher's `resumed` event).

`status` shows them (tools/status.py `failures`), `status --plot` marks them (plot.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..events import (
    EV_FAILURE_SAVE,
    EV_HANG,
    EV_RESTORED,
    EV_RESUMED,
    EV_RUN_ENDED,
    EV_SAVE_COMMITTED,
)

UNWARNED_OUTCOMES = {"failed": "failed", "hung": "hang"}  # run_ended's outcome -> Failure.kind
NOT_RESTARTED = ("give_up", "stop", "finish", "behind", "hold")  # run_ended actions after which no run follows


@dataclass
class Failure:
    """One unwarned failure: where, what the survivors saved, and what it cost the next run."""

    run_id: str | None
    kind: str  # "failed" (a rank died) | "hang" (the hang watch killed the run)
    at: float  # when: the death the launcher saw, else the failure save's start, else the run's end
    step: int | None  # the survivors' boundary, else the dead ranks' last, else the furthest reported
    dead: list[int] = field(default_factory=list)  # the ranks that died (or hung)
    dead_steps: dict[int, int] = field(default_factory=dict)  # their last step boundary (heartbeats)
    trained: int | None = None  # the furthest step boundary any rank reached before the failure
    save: str = "none"  # the failure save: "committed" | "refused" | "failed" | "none"
    save_step: int | None = None  # the step it committed (or tried to)
    save_writer: int | None = None
    save_s: float | None = None
    missing: list[str] = field(default_factory=list)  # refused: the pieces no survivor covered
    error: str | None = None  # failed: the write's error
    action: str | None = None  # the launcher's decision after the run (retry, requeue, give_up, ...)
    resumed_from: int | None = None  # the step the next run restored (0: it started fresh)
    resumed_tier: str | None = None  # where from: "memory" (issue 49) or "file" (None: not logged)
    restore_s: float | None = None  # how long that restore took
    repeated: int | None = None  # trained - resumed_from (None: not resumed, or not known)
    to_first_step_s: float | None = None  # the failure to the next run's first step (None: not yet)
    _ended: bool = field(default=False, repr=False)  # the launcher's run_ended seen (a run follows)
    _closed: bool = field(default=False, repr=False)  # another run ended since: nothing more is ours

    def to_json(self) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if not k.startswith("_")}
        data["dead_steps"] = {str(r): s for r, s in self.dead_steps.items()}
        return data


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def unwarned_failures(events: list[dict[str, Any]]) -> list[Failure]:
    """Pure: every unwarned failure in `events` (oldest first), as the module docstring says.
    Several nodes' `run_ended` of one run are one failure; the first `restored` and `resumed`
    events of another run, logged after the failure and before another run ended, are its
    restart's."""
    found: list[Failure] = []
    by_run: dict[str, Failure] = {}
    committed: dict[str, int] = {}  # the furthest commit of each run (a floor for `trained`)

    def failure(rid: str | None, kind: str, t: float) -> Failure:
        f = by_run.get(rid) if rid is not None else None
        if f is None:  # without a launcher (no run id), each failure save is a failure of its own
            f = Failure(rid, kind, t, None)
            found.append(f)
            if rid is not None:
                by_run[rid] = f
        return f

    for e in events:
        kind, rid, t = e.get("event"), e.get("run_id"), _num(e.get("time")) or 0.0
        rid = rid if isinstance(rid, str) else None
        if kind == EV_SAVE_COMMITTED and rid is not None and _int(e.get("step")) is not None:
            committed[rid] = max(committed.get(rid, 0), e["step"])
        elif kind == EV_FAILURE_SAVE:
            _saved(failure(rid, "failed", t), e, t)
        elif kind == EV_HANG:
            f = failure(rid, "hang", t)
            f.kind = "hang"
            f.dead = sorted(set(f.dead) | {r for r in e.get("ranks") or [] if _int(r) is not None})
            f.trained = _max(f.trained, _int(e.get("step")))
        elif kind == EV_RUN_ENDED:
            if e.get("outcome") in UNWARNED_OUTCOMES:
                f = failure(rid, UNWARNED_OUTCOMES[e["outcome"]], t)
                f.kind = UNWARNED_OUTCOMES[e["outcome"]]
                _ended(f, e)
            for other in found:  # another run ended since: it was the restart, nothing later is ours
                if rid is not None and other.run_id != rid and other._ended:
                    other._closed = True
        elif kind in (EV_RESTORED, EV_RESUMED):
            waiting = _waiting(found, rid)
            if waiting is not None:
                _restarted(waiting, e, kind)
    for f in found:
        f.trained = _max(f.trained, f.save_step, committed.get(f.run_id) if f.run_id is not None else None)
        if f.step is None:
            f.step = max(f.dead_steps.values()) if f.dead_steps else f.trained
        if f.to_first_step_s is not None and f.resumed_from is None:
            f.resumed_from = 0  # it stepped without restoring anything: a fresh start
        if f.resumed_from is not None and f.trained is not None:
            f.repeated = max(0, f.trained - f.resumed_from)
    return found


def _max(*values: int | None) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def _saved(f: Failure, e: dict[str, Any], t: float) -> None:
    """The survivors' failure save: its step is where the failure happened."""
    f.save_step, f.save_writer = _int(e.get("step")), _int(e.get("writer"))
    f.save_s = _num(e.get("seconds"))
    f.missing = [str(m) for m in e.get("missing") or []]
    f.error = str(e["error"]) if e.get("error") else None
    f.save = "committed" if e.get("committed") is True else "refused" if f.missing else "failed"
    f.step = f.save_step if f.save_step is not None else f.step
    f.dead = sorted(set(f.dead) | {r for r in e.get("dead") or [] if _int(r) is not None})
    if f.save_s is not None and not f._ended:
        f.at = min(f.at, t - f.save_s)  # the save began when the survivors saw the death


def _ended(f: Failure, e: dict[str, Any]) -> None:
    """One node's launcher saw the run end (every node logs one)."""
    f._ended = True
    f.action = f.action if f.action in NOT_RESTARTED else e.get("action") or f.action
    f.trained = _max(f.trained, _int(e.get("last_step")))
    steps = e.get("dead_steps")
    if isinstance(steps, dict):
        for r, s in steps.items():
            if str(r).isdigit() and _int(s) is not None and s >= 0:
                f.dead_steps[int(r)] = s
        f.dead = sorted(set(f.dead) | set(f.dead_steps))


def _waiting(found: list[Failure], rid: str | None) -> Failure | None:
    """The newest failure that a restore or first step of run `rid` can belong to: one not
    closed, after which the launcher restarted (or, without a launcher, anything may follow)."""
    f = found[-1] if found else None
    if f is None or f._closed or f.action in NOT_RESTARTED:
        return None
    if f.run_id is not None and rid == f.run_id:
        return None  # the failed run's own restore or first step, before it failed
    return f


def _restarted(f: Failure, e: dict[str, Any], kind: str) -> None:
    if kind == EV_RESTORED:
        if f.resumed_from is None:
            f.resumed_from = _int(e.get("step"))
            f.resumed_tier = e.get("tier") if e.get("tier") in ("memory", "file") else None
            f.restore_s = _num(e.get("restore_s"))
        return
    first = _num(e.get("first_step_at")) or _num(e.get("time"))
    secs = _num(e.get("seconds"))
    if first is None:
        return
    if secs is not None and e.get("cause") in ("failure", "hang"):
        f.at = first - secs  # the launcher's own clock of the death (or the hang's kill)
    took = max(0.0, first - f.at)
    f.to_first_step_s = took if f.to_first_step_s is None else min(f.to_first_step_s, took)  # the first node

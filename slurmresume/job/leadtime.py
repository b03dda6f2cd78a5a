"""Does `--signal-lead` fit the state? Pure functions over the event log (no I/O).

The warning comes `lead` seconds before the kill; between the two the ranks agree on a step
(at most one step), save synchronously and commit. The next emergency save is predicted from
the measured saves: the slowest recent seconds-per-byte rate times the newest checkpoint's size
(a state that grew since the last emergency save is priced at its new size), plus the same
fixed per-save cost. The lead must cover twice that (a slow file-system hour is 2x here, see
docs/benchmarks.md), one step, and MARGIN_S: `required_lead`, shared by `doctor`, `submit`
and `status`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..events import (
    EV_SAVE_COMMITTED,
    EV_SIGNAL_AGREED,
    EV_SIGNAL_FORWARDED,
    EV_SIGTERM,
    EV_STARTED,
    EV_SUBMITTED,
)

MARGIN_S = 10.0  # Slurm's own slack: the signal may come late within its one-minute tick, exit + requeue
RECENT = 16  # saves the prediction looks at
EMERGENCY_REASONS = ("preempt", "terminate")
SIGNAL_EVENTS = (EV_SIGNAL_FORWARDED, EV_SIGNAL_AGREED, EV_SIGTERM)


@dataclass(frozen=True)
class Prediction:
    """The next emergency save's predicted seconds; `basis` says what it rests on."""

    save_s: float
    bytes: int | None
    basis: str  # "rate" (seconds per byte x size) | "seconds" (no sizes logged: the slowest save)
    saves: int


@dataclass(frozen=True)
class LateSave:
    """An emergency save that needed longer than the lead in force (signal -> commit)."""

    step: int
    seconds: float
    lead_s: int
    time: float


@dataclass
class LeadReport:
    """What `status --json` shows under "lead" (seconds; null: not known)."""

    lead_s: int | None
    predicted_save_s: float | None
    predicted_bytes: int | None
    basis: str | None
    required_s: float | None
    margin_s: float | None  # lead - required: negative means the lead is too short
    step_s: float | None
    late: list[LateSave] = field(default_factory=list)


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


def predict_save(events: list[dict[str, Any]], size_now: int | None = None) -> Prediction | None:
    """From the last RECENT committed saves: seconds for a save of `size_now` bytes (default:
    the newest logged size). None when no save was measured."""
    saves = [e for e in events if e.get("event") == EV_SAVE_COMMITTED and _num(e.get("seconds")) is not None]
    saves = saves[-RECENT:]
    if not saves:
        return None
    sized = [(float(e["seconds"]), int(e["bytes"])) for e in saves
             if isinstance(e.get("bytes"), int) and not isinstance(e.get("bytes"), bool) and e["bytes"] > 0]
    size = size_now if size_now else (sized[-1][1] if sized else None)
    if sized and size:
        # slowest rate, and the smallest save's seconds as the fixed part (directory, manifest, marker)
        fixed = min(s for s, _ in sized) if len(sized) > 1 else 0.0
        fixed = min(fixed, 1.0)
        rate = max(max(s - fixed, 0.0) / b for s, b in sized)
        return Prediction(fixed + rate * size, size, "rate", len(saves))
    return Prediction(max(float(e["seconds"]) for e in saves), size, "seconds", len(saves))


def required_lead(save_s: float, step_s: float | None) -> float:
    """Seconds of lead that a save of `save_s` needs: x2 for a slow disk hour, a step, MARGIN_S."""
    return 2 * save_s + (step_s or 0.0) + MARGIN_S


def logged_lead(events: list[dict[str, Any]], before: float | None = None) -> int | None:
    """The --signal-lead of the newest `submitted` event (before time `before`)."""
    for e in reversed(events):
        if before is not None and float(e.get("time") or 0) > before:
            continue
        if e.get("event") == EV_SUBMITTED and isinstance(e.get("signal_lead"), int):
            return int(e["signal_lead"])
    return None


def late_saves(events: list[dict[str, Any]]) -> list[LateSave]:
    """Emergency saves whose signal -> commit time exceeded the lead they ran under: at a time
    limit, Slurm would have killed them before the marker. Uses the signal's logged time when the
    same run logged one, else the save's own seconds."""
    out: list[LateSave] = []
    signal_t: float | None = None
    for e in events:
        name = e.get("event")
        if name in SIGNAL_EVENTS:
            signal_t = signal_t if signal_t is not None else _num(e.get("time"))
        elif name == EV_STARTED:
            signal_t = None
        elif name == EV_SAVE_COMMITTED and e.get("reason") in EMERGENCY_REASONS and _num(e.get("seconds")) is not None:
            t = float(e.get("time") or 0)
            took = float(e["seconds"])
            if signal_t is not None and signal_t <= t:
                took = max(took, t - signal_t)
            lead = logged_lead(events, before=t)
            if lead is not None and took > lead and isinstance(e.get("step"), int):
                out.append(LateSave(int(e["step"]), round(took, 3), lead, t))
            signal_t = None
    return out


def lead_report(events: list[dict[str, Any]], lead_s: int | None = None, step_s: float | None = None,
                size_now: int | None = None) -> LeadReport:
    """Everything `status` and `submit` say about the lead. `lead_s` defaults to the logged one."""
    lead = lead_s if lead_s is not None else logged_lead(events)
    pred = predict_save(events, size_now)
    if pred is None:
        return LeadReport(lead, None, None, None, None, None, step_s, late_saves(events))
    need = required_lead(pred.save_s, step_s)
    margin = None if lead is None else lead - need
    return LeadReport(lead, round(pred.save_s, 3), pred.bytes, pred.basis, round(need, 1),
                      None if margin is None else round(margin, 1), step_s, late_saves(events))


def lead_warning(rep: LeadReport) -> str | None:
    """One line when the lead is shorter than required (None when it fits or nothing is known)."""
    if rep.lead_s is None or rep.required_s is None or rep.predicted_save_s is None or rep.lead_s >= rep.required_s:
        return None
    size = f" for {_gb(rep.predicted_bytes)}" if rep.predicted_bytes else ""
    step = f" + a step ({rep.step_s:.1f} s)" if rep.step_s else ""
    return (f"--signal-lead {rep.lead_s} s is shorter than 2 x the predicted emergency save "
            f"({rep.predicted_save_s:.1f} s{size}){step} + {MARGIN_S:.0f} s margin = {rep.required_s:.0f} s: "
            f"submit with --signal-lead {int(rep.required_s) + 1}")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 10**8 else f"{n / 1e6:.2f} MB"


def late_warning(late: LateSave) -> str:
    return (f"the emergency save of step {late.step} took {late.seconds:.1f} s from the warning, longer than "
            f"--signal-lead {late.lead_s} s: at a time limit it is killed before it commits; submit with a "
            "longer --signal-lead")

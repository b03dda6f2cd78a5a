"""`slurmresume status --plot run.png`: the run's timeline as a picture.

`build_timeline(events)` is pure (the event log -> runs, each a list of (time, step) points
plus what ended it), and so is `preemption_cost(events)` (what each requeue or failure cost:
down time and lost work, their totals and their share of the wall time; `status` shows it in
its headline); `plot_timeline` draws it with matplotlib (an optional extra:
`pip install 'slurmresume[plot]'`), imported only here and only when asked.

What the picture shows: step over wall-clock time, one coloured line per run (a requeue or a
retry starts a new run), a dot per committed save, a triangle per warning signal, a vertical
line per requeue, a cross per failure or hang, a grey band for the time between runs, and for
each interruption the work it cost: the steps (and seconds) between the last commit and the
end of the run, which the next run had to redo.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..contract import EV_EMERGENCY_SAVE_FAILED, EV_RESUMED
from ..errors import ConfigError
from ..events import read_events

END_FAILED = {"failed", "gave_up", "requeue_failed", "interrupted", "no_checkpoint"}


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
    resumed_at: float | None = None  # this run's first step (a restart's end of down time)
    resumed_exact: bool = False  # resumed_at is from the launcher's `resumed` event, not a proxy
    save_failed: bool = False  # warned, but the emergency save did not commit

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
        if kind == "started" and e.get("node") not in (None, 0):
            continue  # every node's launcher logs its start: the first node's is the run's
        if kind == "started":
            cur = Run(t, runs[-1].last[1] if runs and runs[-1].end_kind != "failed" else _restart_step(runs))
            runs.append(cur)
        elif cur is None:
            if kind == "save_committed" and step is not None:  # a library-only run: no launcher events
                cur = Run(t, 0)
                runs.append(cur)
            else:
                continue
        if step is not None and kind not in ("restored", "resumed") and (cur.reached is None or step > cur.reached):
            cur.reached = step
        if kind == "restored" and step is not None:
            cur.start_step = step
            cur.resumed_at = cur.resumed_at or t
        elif kind == EV_RESUMED:  # one per node: the first node to step again ends the down time
            at = e.get("first_step_at")
            at = float(at) if isinstance(at, (int, float)) and not isinstance(at, bool) else t
            cur.resumed_at = min(at, cur.resumed_at) if cur.resumed_exact and cur.resumed_at else at
            cur.resumed_exact = True
        elif kind == EV_EMERGENCY_SAVE_FAILED:
            cur.save_failed = True
        elif kind == "save_committed" and step is not None:
            cur.points.append((t, step))
            cur.resumed_at = cur.resumed_at or t
        elif kind in ("signal_agreed", "signal_forwarded"):
            _warning(cur, t, step)
        elif kind == "requeued":
            requeues.append(t)
            _end(cur, t, "preempt")
        elif kind in END_FAILED or (kind == "run_ended" and e.get("outcome") == "failed"):
            _end(cur, t, "failed")
        elif isinstance(kind, str) and kind.startswith("hang"):
            _end(cur, t, "hang")
        elif kind == "finished":
            _end(cur, t, "finished")
        elif kind == "stopped":
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


def _lost(tl: Timeline) -> None:
    """Work the next run redid: from the last commit to the end of a run no save covered (a
    failure, a hang, a warning whose save failed). Steps are the furthest step an event of the
    run names, else estimated from the speed."""
    rate = tl.rate()
    for r in tl.runs:
        if r.end is not None and (r.end_kind in ("failed", "hang") or r.save_failed):
            r.lost_s = max(0.0, r.end - r.last[0])
            if r.reached is not None and r.reached > r.last[1]:
                r.lost_steps = r.reached - r.last[1]
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


def interruptions(tl: Timeline) -> list[Interruption]:
    """Pure: every run that ended in a requeue, a failure or a hang and was (or will be) resumed."""
    out = []
    for i, r in enumerate(tl.runs):
        if r.end is None or r.end_kind not in ("preempt", "failed", "hang"):
            continue
        nxt = tl.runs[i + 1] if i + 1 < len(tl.runs) else None
        warned = r.end_kind == "preempt" and bool(r.warnings)
        at, step = (r.warnings[0] if warned else (r.end, r.last[1]))
        resumed = nxt.resumed_at if nxt is not None else None
        down = max(0.0, resumed - at) if resumed is not None else None
        out.append(Interruption(r.end_kind, at, step, resumed, down, r.lost_s, r.lost_steps, r.lost_estimated))
    return out


def preemption_cost(events: list[dict[str, Any]], now: float | None = None) -> Cost | None:
    """Pure: the down time and lost work of every interruption in the log, their totals and the
    wall time they are a share of; None when no run was interrupted."""
    tl = build_timeline(events)
    _lost(tl)
    return _cost(tl, now)


def _cost(tl: Timeline, now: float | None) -> Cost | None:
    found = interruptions(tl)
    if not found:
        return None
    end = max(tl.t_end, now) if tl.runs[-1].end is None and now is not None else tl.t_end
    return Cost(found, sum(i.down_s or 0.0 for i in found), sum(i.lost_s for i in found),
                max(0.0, end - tl.runs[0].start))


def plot_timeline(root: Path, out: Path, now: float | None = None) -> Path:
    """Draw the timeline of `root`'s event log into the PNG `out`. ConfigError without
    matplotlib or without any event to draw."""
    if out.is_dir():
        raise ConfigError(f"--plot {out} is a directory: give a file name, e.g. {out / 'run.png'}")
    fig = render_timeline(read_events(root), now, source=root / "events.jsonl")
    import matplotlib.pyplot as plt

    fig.savefig(out)
    plt.close(fig)
    return out


def render_timeline(events: list[dict[str, Any]], now: float | None = None, source: Path | None = None) -> Any:
    """The timeline of `events` as a matplotlib Figure (not saved: tests read what it draws).
    ConfigError without matplotlib or without a run to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'slurmresume[plot]'") from None
    tl = build_timeline(events)
    if not tl.runs:
        raise ConfigError(f"nothing to plot: no run or save in {source or 'the event log'} yet")
    _lost(tl)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    _draw(ax, tl, now)
    fig.tight_layout()
    return fig


def _scale(tl: Timeline) -> tuple[float, str]:
    span = tl.t_end - tl.t0
    return (3600.0, "hours") if span > 3 * 3600 else (60.0, "minutes") if span > 180 else (1.0, "seconds")


def _draw(ax: Any, tl: Timeline, now: float | None) -> None:
    unit, label = _scale(tl)
    x = lambda t: (t - tl.t0) / unit  # noqa: E731
    rate = tl.rate()
    top = max([r.last[1] for r in tl.runs] + [r.last[1] + r.lost_steps for r in tl.runs]
              + [s for r in tl.runs for _, s in r.warnings] + [1])
    for i, r in enumerate(tl.runs):
        colour = f"C{i % 10}"
        flat = [(r.resumed_at, r.start_step)] if r.resumed_at is not None and r.start_step else []
        pts = [(r.start, r.start_step), *flat, *r.points]  # a restart makes no progress before its first step
        ax.plot([x(t) for t, _ in pts], [s for _, s in pts], "-", color=colour, lw=2,
                label=f"run {i + 1}" + (f" (from step {r.start_step})" if r.start_step else ""))
        ax.plot([x(t) for t, _ in r.points], [s for _, s in r.points], "o", color=colour, ms=4)
        for t, s in r.warnings:
            ax.plot(x(t), s, marker="v", color="darkorange", ms=11, mec="black", zorder=5)
        if r.end is not None and r.lost_s > 0:
            t_c, s_c = r.last
            s_end = s_c + r.lost_steps
            ax.plot([x(t_c), x(r.end)], [s_c, s_end], ":", color=colour, lw=2)
            ax.axvspan(x(t_c), x(r.end), color="red", alpha=0.12, lw=0)
            ax.plot(x(r.end), s_end, marker="X", color="purple" if r.end_kind == "hang" else "red", ms=12,
                    mec="black", zorder=5)
            ax.annotate(f"{'save failed' if r.save_failed else r.end_kind}: lost {_lost_text(r)}",
                        (x(r.end), s_end), xytext=(8, 10), textcoords="offset points",
                        color="darkred", fontsize=9, fontweight="bold")
        elif r.end_kind == "preempt" and r.end is not None:
            ax.annotate(f"preempted: saved step {r.last[1]}, 0 lost", (x(r.end), r.last[1]), xytext=(8, -16),
                        textcoords="offset points", color="darkorange", fontsize=9)
        if r.end_kind == "finished" and r.end is not None:
            ax.plot(x(r.end), r.last[1], marker="*", color="green", ms=16, mec="black", zorder=5)
    for it in interruptions(tl):
        if it.resumed_at is None:
            continue
        ax.axvspan(x(it.at), x(it.resumed_at), color="grey", alpha=0.18, lw=0)
        ax.text(x((it.at + it.resumed_at) / 2), top * 0.02, f"down\n{_secs(it.down_s or 0.0)}", ha="center",
                va="bottom", fontsize=8, color="dimgrey")
    for t in tl.requeues:
        ax.axvline(x(t), color="royalblue", ls="--", lw=1)
    _legend(ax)
    ax.set_xlabel(f"wall-clock time since the first event ({label})")
    ax.set_ylabel("training step")
    ax.set_ylim(-0.02 * top, top * 1.12)
    ax.grid(alpha=0.3)
    ax.set_title(title(tl, now, rate), fontsize=11)


def title(tl: Timeline, now: float | None, rate: float | None) -> str:
    """Runs, requeues, failures; the measured down time and lost work, and their share of the wall time."""
    fails = sum(r.end_kind in ("failed", "hang") for r in tl.runs)
    head = f"{len(tl.runs)} run(s), {len(tl.requeues)} requeue(s), {fails} failure(s)"
    speed = f", {rate:.3g} steps/s" if rate else ""
    cost = _cost(tl, now)
    return f"{head}{speed}\n" + ("no interruption" if cost is None else cost_line(cost))


def cost_line(cost: Cost) -> str:
    """'down 13.9s + 9.4s + 7.3s, work lost 0s: 64% of 48.0s wall time' (plot title, status headline)."""
    downs = [i.down_s for i in cost.interruptions if i.down_s is not None]
    down = " + ".join(_secs(d) for d in downs) if 1 < len(downs) <= 4 else _secs(cost.down_s)
    steps = sum(i.lost_steps for i in cost.interruptions)
    approx = "~" if any(i.lost_estimated for i in cost.interruptions) else ""
    lost = _secs(cost.lost_s) + (f" ({approx}{steps} steps)" if steps else "")
    share = f": {cost.fraction:.0%} of {_secs(cost.wall_s)} wall time" if cost.fraction is not None else ""
    return f"down {down}, work lost {lost}{share}"


def _lost_text(r: Run) -> str:
    return _secs(r.lost_s) + (f", {'~' if r.lost_estimated else ''}{r.lost_steps} steps" if r.lost_steps else "")


def _legend(ax: Any) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], marker="o", ls="", color="black", ms=4, label="committed save"),
                Line2D([], [], marker="v", ls="", color="darkorange", mec="black", ms=9, label="warning signal"),
                Line2D([], [], ls="--", color="royalblue", label="requeue"),
                Line2D([], [], marker="X", ls="", color="red", mec="black", ms=9, label="failure / hang"),
                Patch(color="red", alpha=0.12, label="work lost (redone)"),
                Patch(color="grey", alpha=0.18, label="down: warning or failure to first resumed step")]
    ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)


def _secs(s: float) -> str:
    """Seconds with one decimal under a minute (a restart takes seconds), else as elsewhere."""
    if s < 60:
        return f"{s:.1f}s"
    from ..duration import format_duration

    return format_duration(s)

"""`slurmresume status --plot run.png`: the run's timeline as a picture.

`build_timeline(events)` is pure (the event log -> runs, each a list of (time, step) points
plus what ended it); `plot_timeline` draws it with matplotlib (an optional extra:
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

    @property
    def last(self) -> tuple[float, int]:
        return self.points[-1] if self.points else (self.start, self.start_step)


@dataclass
class Timeline:
    t0: float
    runs: list[Run]
    requeues: list[float]

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
        if kind == "started":
            cur = Run(t, runs[-1].last[1] if runs and runs[-1].end_kind != "failed" else _restart_step(runs))
            runs.append(cur)
        elif cur is None:
            if kind == "save_committed" and step is not None:  # a library-only run: no launcher events
                cur = Run(t, 0)
                runs.append(cur)
            else:
                continue
        if kind == "restored" and step is not None:
            cur.start_step = step
        elif kind == "save_committed" and step is not None:
            cur.points.append((t, step))
        elif kind in ("signal_agreed", "signal_forwarded") and not (cur.warnings and t - cur.warnings[-1][0] < 5):
            cur.warnings.append((t, step if step is not None else cur.last[1]))
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
    return Timeline(_t(events[0]) or 0.0, runs, requeues)


def _restart_step(runs: list[Run]) -> int:
    """A run after a failure restarts from the newest commit before it."""
    return max((r.last[1] for r in runs if r.points), default=0)


def _end(run: Run, t: float, kind: str) -> None:
    if run.end is None or kind == "failed":
        run.end, run.end_kind = t, kind


def _lost(tl: Timeline) -> None:
    rate = tl.rate()
    for r in tl.runs:
        if r.end is not None and r.end_kind in ("failed", "hang"):
            r.lost_s = max(0.0, r.end - r.last[0])
            r.lost_steps = int(r.lost_s * rate) if rate else 0


def plot_timeline(root: Path, out: Path, now: float | None = None) -> Path:
    """Draw the timeline of `root`'s event log into the PNG `out`. ConfigError without
    matplotlib or without any event to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'slurmresume[plot]'") from None
    tl = build_timeline(read_events(root))
    if not tl.runs:
        raise ConfigError(f"nothing to plot: no run or save in {root / 'events.jsonl'} yet")
    if out.is_dir():
        raise ConfigError(f"--plot {out} is a directory: give a file name, e.g. {out / 'run.png'}")
    _lost(tl)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    _draw(ax, tl, now)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def _scale(tl: Timeline) -> tuple[float, str]:
    span = max((r.end or r.last[0]) for r in tl.runs) - tl.t0
    return (3600.0, "hours") if span > 3 * 3600 else (60.0, "minutes") if span > 180 else (1.0, "seconds")


def _draw(ax: Any, tl: Timeline, now: float | None) -> None:
    unit, label = _scale(tl)
    x = lambda t: (t - tl.t0) / unit  # noqa: E731
    rate = tl.rate()
    top = max([r.last[1] for r in tl.runs] + [r.last[1] + r.lost_steps for r in tl.runs] + [1])
    for i, r in enumerate(tl.runs):
        colour = f"C{i % 10}"
        pts = [(r.start, r.start_step), *r.points]
        ax.plot([x(t) for t, _ in pts], [s for _, s in pts], "-", color=colour, lw=2,
                label=f"run {i + 1}" + (f" (from step {r.start_step})" if r.start_step else ""))
        ax.plot([x(t) for t, _ in r.points], [s for _, s in r.points], "o", color=colour, ms=4)
        for t, s in r.warnings:
            ax.plot(x(t), s, marker="v", color="darkorange", ms=11, mec="black", zorder=5)
        if r.end is not None and r.end_kind in ("failed", "hang"):
            t_c, s_c = r.last
            s_end = s_c + r.lost_steps
            ax.plot([x(t_c), x(r.end)], [s_c, s_end], ":", color=colour, lw=2)
            ax.axvspan(x(t_c), x(r.end), color="red", alpha=0.12, lw=0)
            ax.plot(x(r.end), s_end, marker="X", color="red" if r.end_kind == "failed" else "purple", ms=12,
                    mec="black", zorder=5)
            lost = _fmt(r.lost_s) + (f", ~{r.lost_steps} steps" if r.lost_steps else "")
            ax.annotate(f"{r.end_kind}: lost {lost}", (x(r.end), s_end), xytext=(8, 10), textcoords="offset points",
                        color="darkred", fontsize=9, fontweight="bold")
        elif r.end_kind == "preempt" and r.end is not None:
            ax.annotate(f"preempted: saved step {r.last[1]}, 0 lost", (x(r.end), r.last[1]), xytext=(8, -16),
                        textcoords="offset points", color="darkorange", fontsize=9)
        nxt = tl.runs[i + 1].start if i + 1 < len(tl.runs) else None
        if r.end is not None and nxt is not None and nxt > r.end:
            ax.axvspan(x(r.end), x(nxt), color="grey", alpha=0.18, lw=0)
            ax.text(x((r.end + nxt) / 2), top * 0.02, f"down\n{_fmt(nxt - r.end)}", ha="center", va="bottom",
                    fontsize=8, color="dimgrey")
        if r.end_kind == "finished" and r.end is not None:
            ax.plot(x(r.end), r.last[1], marker="*", color="green", ms=16, mec="black", zorder=5)
    for t in tl.requeues:
        ax.axvline(x(t), color="royalblue", ls="--", lw=1)
    _legend(ax)
    ax.set_xlabel(f"wall-clock time since the first event ({label})")
    ax.set_ylabel("training step")
    ax.set_ylim(-0.02 * top, top * 1.12)
    ax.grid(alpha=0.3)
    total_lost = sum(r.lost_s for r in tl.runs)
    speed = f", {rate:.3g} steps/s" if rate else ""
    ax.set_title(f"{len(tl.runs)} run(s), {len(tl.requeues)} requeue(s), "
                 f"{sum(r.end_kind in ('failed', 'hang') for r in tl.runs)} failure(s); "
                 f"work lost {_fmt(total_lost)}{speed}", fontsize=11)


def _legend(ax: Any) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles, _ = ax.get_legend_handles_labels()
    handles += [Line2D([], [], marker="o", ls="", color="black", ms=4, label="committed save"),
                Line2D([], [], marker="v", ls="", color="darkorange", mec="black", ms=9, label="warning signal"),
                Line2D([], [], ls="--", color="royalblue", label="requeue"),
                Line2D([], [], marker="X", ls="", color="red", mec="black", ms=9, label="failure / hang"),
                Patch(color="red", alpha=0.12, label="work lost (redone)"),
                Patch(color="grey", alpha=0.18, label="not running")]
    ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)


def _fmt(s: float) -> str:
    from ..duration import format_duration

    return format_duration(s)

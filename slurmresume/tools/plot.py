"""`slurmresume status --plot run.png`: the run's timeline as a picture.

`render_timeline(events)` draws what timeline.py computes (pure: the runs, their warnings and
ends, and what each interruption cost) with matplotlib (an optional extra:
`pip install 'slurmresume[plot]'`), imported only here and only when asked, and returns the
figure; `plot_timeline` saves it.

What the picture shows: step over wall-clock time, one coloured line per run (a requeue or a
retry starts a new run; flat until its first step), a dot per committed save, a triangle per
warning signal at the step the ranks agreed on, a vertical line per requeue, a cross per failure
or hang, a grey band per interruption labelled with its measured down time (the warning, or the
failure, to the first resumed step), a red band and label for the work a failure cost (the
seconds and steps since the last commit, which the next run redid), a diamond per unwarned
failure at the step it happened, coloured by its failure save (green committed, orange refused
or failed, grey none) and labelled with the steps repeated and the time to the first resumed step
(failures.py), and a title with the totals and their share of the wall time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..events import read_events
from .failures import Failure, unwarned_failures
from .timeline import (
    Run,
    Timeline,
    build_timeline,
    cost_line,
    cost_of,
    interruptions,
    mark_lost,
    secs,
)

# What --plot writes, by the file's extension (matplotlib's Agg and its vector backends).
PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")


def plot_path(out: Path) -> Path:
    """Pure: the file `--plot out` writes: `out` itself when its extension is one of
    PLOT_FORMATS, `out` + ".png" when it has none. ConfigError naming the formats otherwise."""
    if out.is_dir():
        raise ConfigError(f"--plot {out} is a directory: give a file name, e.g. {out / 'run.png'}")
    ext = out.suffix.lower().lstrip(".")
    if not ext:
        return out.with_name(out.name + ".png")
    if ext not in PLOT_FORMATS:
        raise ConfigError(f"--plot {out}: .{ext} is not a picture format --plot writes: end the name with "
                          f"{', '.join('.' + f for f in PLOT_FORMATS)}")
    return out


def plot_timeline(root: Path, out: Path, now: float | None = None) -> Path:
    """Draw the timeline of `root`'s event log into `plot_path(out)` and return that path.
    ConfigError for a format it cannot write, without matplotlib or without any event to draw."""
    path = plot_path(out)
    fig = render_timeline(read_events(root), now, source=root / "events.jsonl")
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, format=path.suffix.lstrip(".").lower())
    except ValueError as exc:  # a format this matplotlib lacks (its message names the ones it has)
        raise ConfigError(f"--plot {path}: {exc}") from None
    finally:
        plt.close(fig)
    return path


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
    mark_lost(tl)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    _draw(ax, tl, now)
    failures = unwarned_failures(events)
    if failures:
        _draw_failures(ax, tl, failures)
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
    for it in interruptions(tl, now):
        if it.down_s is None:
            continue
        back = it.at + it.down_s  # the first resumed step, or now while still down
        ax.axvspan(x(it.at), x(back), color="grey", alpha=0.18, lw=0)
        words = f"down\n{secs(it.down_s)}" + ("\n(still)" if it.ongoing else "")
        ax.text(x((it.at + back) / 2), top * 0.02, words, ha="center", va="bottom", fontsize=8, color="dimgrey")
    for t in tl.requeues:
        ax.axvline(x(t), color="royalblue", ls="--", lw=1)
    _legend(ax)
    ax.set_xlabel(f"wall-clock time since the first event ({label})")
    ax.set_ylabel("training step")
    ax.set_ylim(-0.02 * top, top * 1.12)
    ax.grid(alpha=0.3)
    ax.set_title(title(tl, now, rate), fontsize=11)


SAVE_COLOUR = {"committed": "green", "refused": "darkorange", "failed": "darkorange", "none": "grey"}


def failure_label(f: Failure) -> str:
    """What a failure's diamond says: the failure save, the steps repeated, the time to step again."""
    save = {"committed": f"failure save: step {f.save_step} committed", "refused": "failure save refused",
            "failed": "failure save failed", "none": "no failure save"}[f.save]
    cost = [f"{f.repeated} step{'' if f.repeated == 1 else 's'} repeated"] if f.repeated is not None else []
    if f.to_first_step_s is not None:
        cost.append(f"first step after {secs(f.to_first_step_s)}")
    return save + ("\n" + ", ".join(cost) if cost else "")


def _draw_failures(ax: Any, tl: Timeline, failures: list[Failure]) -> None:
    """A diamond per unwarned failure at the step it happened, coloured by its failure save
    (green: committed; orange: refused or failed; grey: none), labelled with what it cost. It
    sits on the failed run's end (its cross), the nearest in time."""
    unit = _scale(tl)[0]
    ends = [r.end for r in tl.runs if r.end is not None and r.end_kind in ("failed", "hang")]
    for f in failures:
        if f.step is None:
            continue
        t = min(ends, key=lambda e: abs(e - f.at)) if ends else f.at
        ax.plot((t - tl.t0) / unit, f.step, marker="D", color=SAVE_COLOUR[f.save], ms=9, mec="black", zorder=6)
        ax.annotate(failure_label(f), ((t - tl.t0) / unit, f.step), xytext=(8, -30), textcoords="offset points",
                    color="darkgreen" if f.save == "committed" else "saddlebrown", fontsize=8)
    from matplotlib.lines import Line2D

    legend = ax.get_legend()
    handles = list(legend.legend_handles) if legend is not None else []
    handles.append(Line2D([], [], marker="D", ls="", color="green", mec="black", ms=7,
                          label="unwarned failure: failure save (green committed, orange refused, grey none)"))
    ax.legend(handles=handles, loc="upper left", fontsize=8, framealpha=0.9)


def title(tl: Timeline, now: float | None, rate: float | None) -> str:
    """Runs, requeues, failures; the measured down time and lost work, and their share of the wall time."""
    fails = sum(r.end_kind in ("failed", "hang") for r in tl.runs)
    head = f"{len(tl.runs)} run(s), {len(tl.requeues)} requeue(s), {fails} failure(s)"
    speed = f", {rate:.3g} steps/s" if rate else ""
    cost = cost_of(tl, now)
    return f"{head}{speed}\n" + ("no interruption" if cost is None else cost_line(cost))


def _lost_text(r: Run) -> str:
    return secs(r.lost_s) + (f", {'~' if r.lost_estimated else ''}{r.lost_steps} steps" if r.lost_steps else "")


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

"""The pieces every rich view stands on: the console, the progress bar, and the short forms of
sizes, times, metrics and logged events."""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from ..events import EV_EXIT_AFTER_SAVE, EV_SAVE_COMMITTED, EV_SIGNAL_AGREED

_STD_FIELDS = {"time", "event", "host", "pid", "job_id", "restart", "run_id"}


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


@contextmanager
def progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A `progress(done, total)` callback that draws a bar on stderr when stderr is a terminal,
    and does nothing in a pipe or a log file (the bar disappears when done)."""
    err = console(stderr=True)
    if not err.is_terminal:
        yield lambda done, total: None
        return
    with Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err,
                  transient=True) as bar:
        task = bar.add_task(what, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    raise AssertionError("unreachable")


def when(t: float, short: bool = False) -> str:
    return time.strftime("%b %d %H:%M" if short else "%Y-%m-%d %H:%M:%S", time.localtime(t))


def metrics_text(metrics: Any) -> str:
    if not isinstance(metrics, dict):
        return "" if metrics is None else str(metrics)
    parts = [f"{k}={v}" if isinstance(v, (bool, str, numbers.Integral)) else f"{k}={float(v):.4g}"
             for k, v in metrics.items() if isinstance(v, (str, bool, numbers.Real))]
    return ", ".join(parts)


def event_details(e: dict[str, Any]) -> str:
    """One line for a logged event: the well-known kinds read naturally, others as key=value."""
    kind = e.get("event")
    if kind == EV_SAVE_COMMITTED:
        return f"step {e.get('step')} in {e.get('seconds', 0):.2f} s ({e.get('reason', '?')})"
    if kind in (EV_SIGNAL_AGREED, EV_EXIT_AFTER_SAVE):
        return f"step {e.get('step')}, {e.get('kind', '?')}"
    return ", ".join(f"{k}={v}" for k, v in e.items() if k not in _STD_FIELDS and v is not None)

"""Rich rendering of status, prune plans and verify results: the one rich importer besides cli.py.

Functions here take computed data (status.Status, retention.PrunePlan, ...) and print it; they
decide nothing. Width comes from the terminal (or $COLUMNS, which tests fix).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from .duration import format_duration
from .policy import RECENT_SAVES, IntervalSummary
from .retention import PrunePlan, PruneResult
from .status import Status, VerifyResult

if TYPE_CHECKING:
    from .inspect import CheckpointReport

_HEALTH = {"ok": "bold green", "warning": "bold yellow", "error": "bold red"}
_STATE = {"complete": "green", "corrupt": "bold red", "being_written": "cyan", "incomplete": "yellow"}
_STD_FIELDS = {"time", "event", "host", "pid", "job_id", "restart", "run_id"}


def console(stderr: bool = False) -> Console:
    return Console(stderr=stderr, highlight=False, soft_wrap=False)


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
    if kind == "save_committed":
        return f"step {e.get('step')} in {e.get('seconds', 0):.2f} s ({e.get('reason', '?')})"
    if kind in ("signal_agreed", "exit_after_save"):
        return f"step {e.get('step')}, {e.get('kind', '?')}"
    return ", ".join(f"{k}={v}" for k, v in e.items() if k not in _STD_FIELDS and v is not None)


def status_view(st: Status, limit: int = 20) -> RenderableType:
    """The whole status screen as one renderable (also what `--watch` refreshes)."""
    head = Text.assemble(("slurmresume status ", "bold"), (st.root, "bold blue"), "   health: ",
                         (st.health.upper(), _HEALTH[st.health]))
    job = st.job
    if job.job_id and job.state:
        line = f"job {job.job_id}: {job.state} ({job.source}), elapsed {job.elapsed or '?'}, Slurm runs {job.runs}"
        line += f", exit {job.exit_code}" if job.exit_code else ""
        line += f", reason {job.reason}" if job.reason and job.reason != "None" else ""
    else:
        line = f"job {job.job_id or '?'}: state unknown"
    parts: list[RenderableType] = [head, Text(f"{line}; requeued {st.requeues}x (event log)")]
    if st.slurm.get("note"):
        parts.append(Text(st.slurm["note"], style="dim"))
    parts += [Text(f"problem: {m}", style="red") for m in st.problems]
    parts += [Text(f"warning: {m}", style="yellow") for m in st.warnings]
    if st.interval is not None:
        parts.append(interval_view(st.interval))
    if st.history:
        parts.append(_history_table(st.history))
    parts.append(_checkpoint_table(st, limit))
    return Group(*parts)


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.2g}%" if x < 0.01 else f"{100 * x:.1f}%"


def interval_view(iv: IntervalSummary) -> RenderableType:
    """Three lines: the interval (and what auto would choose), its inputs, the expected loss."""
    fd = format_duration
    first = (f"save interval: {fd(iv.current_s)} ({iv.source})" if iv.current_s is not None
             else "save interval: none observed yet")
    if iv.auto_s is not None:
        first += f"; auto would choose {fd(iv.auto_s)} (Young/Daly, within {fd(iv.min_s)}..{fd(iv.max_s)})"
    cost = (f"save cost {iv.save_cost_s:.2f} s (median of the last {min(iv.saves, RECENT_SAVES)} saves)"
            if iv.save_cost_s is not None else "save cost unknown (no save yet)")
    speed = f", {iv.steps_per_second:.3g} steps/s" if iv.steps_per_second else ""
    rate = f"{iv.failures_per_hour:.2g}/h" if iv.failures_per_hour is not None else "rate unknown"
    mtbf = f", MTBF {fd(iv.mtbf_s)}" if iv.mtbf_s else ""
    second = (f"{cost}{speed}; {iv.interruptions} unwarned interruption(s) in {fd(iv.runtime_s)} "
              f"of running ({rate}{mtbf})")
    lines = [Text(first), Text(second, style="dim")]
    loss = iv.expected_loss
    if loss is not None:
        fail = (f"{_pct(loss['failures'])} redoing work after unwarned failures, total {_pct(loss['total'])}"
                if loss["failures"] is not None else "no unwarned failure seen to redo work after")
        lines.append(Text(f"expected time lost at {fd(loss['interval_s'])}: {_pct(loss['saves'])} saving, {fail}",
                          style="dim"))
    return Group(*lines)


def _history_table(history: Sequence[dict[str, Any]]) -> Table:
    t = Table(title="history (event log, oldest first)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("time", "event", "job", "details"):
        t.add_column(col)
    for e in history:
        t.add_row(when(float(e.get("time", 0))), str(e.get("event")), str(e.get("job_id") or ""), event_details(e))
    return t


def _checkpoint_table(st: Status, limit: int) -> RenderableType:
    if not st.checkpoints:
        return Text("no checkpoint directories yet", style="yellow")
    shown = [r for i, r in enumerate(st.checkpoints) if not limit or i < limit or r.best or r.newest]
    t = Table(title="checkpoints (newest first)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("step", "state", "created (age)", "size", "ranks", "checksum", "metrics"):
        t.add_column(col, justify="right" if col in ("step", "size", "ranks") else "left",
                     no_wrap=col in ("step", "size", "ranks", "checksum"))
    for r in shown:
        state = Text(r.state.replace("_", " "), style=_STATE[r.state])
        for flag, on in (("newest", r.newest), ("best", r.best)):
            if on:
                state.append(f", {flag}", style="bold")
        checksum = {None: "-", True: "ok", False: "FAILED"}[r.verified]
        t.add_row(str(r.step), state, f"{when(r.created, short=True)} ({format_duration(r.age_seconds)})",
                  size(r.bytes), str(r.shards or "-"), checksum, metrics_text(r.metrics))
    hidden = len(st.checkpoints) - len(shown) + st.omitted
    if not hidden:
        return t
    return Group(t, Text(f"... {hidden} older not shown (--limit 0 shows all)", style="dim"))


def print_status(st: Status, limit: int = 20) -> None:
    console().print(status_view(st, limit))


def watch(compute: Callable[[], Status], interval: float, limit: int = 20) -> None:
    """Redraw the status every `interval` seconds until Ctrl-C."""
    try:
        with Live(console=console(), auto_refresh=False) as live:
            while True:
                live.update(status_view(compute(), limit), refresh=True)
                time.sleep(interval)
    except KeyboardInterrupt:
        pass


def print_plan(plan: PrunePlan, leftovers: Sequence[str], dry_run: bool) -> None:
    t = Table(title="prune plan (newest first)", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("step", "directory", "action", "why"):
        t.add_column(col, justify="right" if col == "step" else "left")
    for d in plan.decisions:
        action = Text("DELETE", style="bold red") if d.delete else Text("keep", style="green")
        t.add_row(str(d.record.step), d.record.name, action, "; ".join(d.reasons))
    out = console()
    out.print(t if plan.decisions else Text("no checkpoint directories"))
    if leftovers:
        out.print(f"also removes {len(leftovers)} leftover partial deletion(s): {', '.join(leftovers[:3])}")
    summary = f"plan: delete {len(plan.delete)}, keep {len(plan.keep)}"
    out.print(summary + (" (dry run: nothing deleted)" if dry_run else ""))


def print_result(result: PruneResult) -> None:
    out = console()
    for name in result.deleted:
        out.print(f"deleted {name}")
    for name, why in result.skipped:
        out.print(f"kept {name}: {why}", style="yellow")
    if result.cleaned:
        out.print(f"removed {len(result.cleaned)} leftover partial deletion(s)")
    out.print(f"done: {len(result.deleted)} deleted, {len(result.skipped)} kept after re-checking")


def print_verify(results: Sequence[VerifyResult]) -> None:
    out = console()
    for r in results:
        if r.ok:
            out.print(Text.assemble(("ok    ", "green"), f"step {r.step}  {r.path}"))
            continue
        out.print(Text.assemble(("FAIL  ", "bold red"), f"step {r.step}  {r.path}"))
        for p in r.problems:
            out.print(f"      {p}")


def _num(v: Any) -> str:
    return "-" if v is None else str(v) if isinstance(v, numbers.Integral) else f"{float(v):.4g}"


def _count(n: int) -> Text:
    return Text(str(n), style="bold red" if n else "")


def inspect_view(r: CheckpointReport) -> RenderableType:
    """`slurmresume inspect`: a summary, the state keys, and one row per tensor."""
    parts: list[RenderableType] = [
        Text.assemble(("checkpoint ", "bold"), (f"step {r.step}", "bold blue"), f"  {r.path}"),
        Text(f"written by {r.world_size} rank(s) on {when(r.created)}, {size(r.bytes)} in "
             f"{len(r.tensors)} tensors"),
    ]
    if r.metrics is not None:
        parts.append(Text(f"metrics: {metrics_text(r.metrics)}"))
    if r.stats_computed:
        nan, inf = r.count("nan_count") or 0, r.count("inf_count") or 0
        bad = [t for t in r.tensors if t.stats is not None and (t.stats.nan_count or t.stats.inf_count)]
        parts.append(Text(f"{nan} NaN and {inf} Inf values in {len(bad)} tensor(s)",
                          style="bold red" if bad else "green"))
    keys = Table(title="state keys", title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("key", "kind", "tensors", "size", "ranks"):
        keys.add_column(col, justify="right" if col in ("tensors", "size") else "left")
    for k in r.state:
        ranks = "all" if len(k.ranks) == r.world_size else ",".join(map(str, k.ranks))
        keys.add_row(k.key, k.kind, str(k.tensors), size(k.bytes), ranks)
    parts.append(keys)
    if r.library:
        parts.append(Text(f"also stored by slurmresume: {', '.join(r.library)}", style="dim"))
    parts.append(_tensor_table(r))
    return Group(*parts)


def _tensor_table(r: CheckpointReport) -> Table:
    t = Table(title="tensors", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    cols = ["name"] + (["rank"] if r.world_size > 1 else []) + ["dtype", "shape", "size"]
    cols += ["min", "max", "mean", "NaN", "Inf"] if r.stats_computed else []
    for col in cols:
        t.add_column(col, justify="left" if col in ("name", "dtype", "shape") else "right",
                     overflow="fold", no_wrap=col != "name", min_width=12 if col == "name" else None)
    for x in r.tensors:
        row: list[Any] = [x.name] + ([str(x.rank)] if r.world_size > 1 else [])
        row += [x.dtype, "x".join(map(str, x.shape)) or "scalar", size(x.bytes)]
        if x.stats is not None:
            st = x.stats
            row += [_num(st.min), _num(st.max), _num(st.mean), _count(st.nan_count), _count(st.inf_count)]
        elif r.stats_computed:
            row += ["-"] * 5
        t.add_row(*row)
    return t


def print_inspect(report: CheckpointReport) -> None:
    console().print(inspect_view(report))

"""Rich rendering of status, prune plans and verify results: the one rich importer besides cli.py.

Functions here take computed data (status.Status, retention.PrunePlan, ...) and print it; they
decide nothing. Width comes from the terminal (or $COLUMNS, which tests fix).
"""

from __future__ import annotations

import numbers
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from ..duration import format_duration
from ..retention import PrunePlan, PruneResult
from ..tools.status import Status, VerifyResult
from ..train.breakdown import describe as describe_breakdown
from ..train.policy import RECENT_SAVES, IntervalSummary

if TYPE_CHECKING:
    from ..tools.inspect import CheckpointReport

_STATE = {"complete": "green", "corrupt": "bold red", "being_written": "cyan", "incomplete": "yellow",
          "unreadable": "bold yellow"}
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
    if kind == "save_committed":
        return f"step {e.get('step')} in {e.get('seconds', 0):.2f} s ({e.get('reason', '?')})"
    if kind in ("signal_agreed", "exit_after_save"):
        return f"step {e.get('step')}, {e.get('kind', '?')}"
    return ", ".join(f"{k}={v}" for k, v in e.items() if k not in _STD_FIELDS and v is not None)


_VERDICT = {"healthy": "bold green", "starting": "bold cyan", "finished": "bold green", "at_risk": "bold yellow",
            "stopped": "bold red", "unknown": "bold magenta"}


def headline_view(st: Status) -> list[Text]:
    """Three lines: the verdict and why; the last step, its age, speed and ETA; the newest
    complete checkpoint, its age, and the work a crash now would lose; after a requeue or a
    failure, a fourth: their measured down time and lost work, and its share of the wall time."""
    fd, h, job = format_duration, st.verdict, st.job
    assert h is not None
    first = Text.assemble((h.verdict.replace("_", " ").upper(), _VERDICT[h.verdict]), f"  {h.reason}")
    if job.job_id:
        first.append(f"  (job {job.job_id}" + (f" {job.state}" if job.state else "")
                     + (f", requeued {st.requeues}x" if st.requeues else "") + ")", style="dim")
    elif st.requeues:
        first.append(f"  (restarted {st.requeues}x)", style="dim")
    if h.last_step is None:
        second = "step: none logged yet"
    else:
        second = f"step {h.last_step}" + (f", {fd(st.now - h.last_step_time)} ago" if h.last_step_time else "")
        if h.steps_per_second:
            second += f"; {h.steps_per_second:.3g} steps/s"
        if h.eta_s is not None:
            second += f"; ETA {fd(h.eta_s)} to step {h.total_steps}"
    if h.checkpoint_step is None:
        live = h.last_step is not None and h.verdict in ("healthy", "at_risk")
        third = Text("checkpoint: none complete yet" + ("; a crash now loses all work" if live else ""),
                     style="yellow" if live else "")
    else:
        third = Text(f"checkpoint step {h.checkpoint_step}, {fd(st.now - (h.checkpoint_time or st.now))} old")
        if h.at_stake_s is not None:
            lost = f"{fd(h.at_stake_s)}" + (f" ({h.at_stake_steps} steps)" if h.at_stake_steps else "")
            third.append(f"; a crash now loses {lost} of work")
    cost = st.preemption_cost  # the fourth line: what requeues and failures cost so far
    return [first, Text(second), third] + ([Text(f"interruptions: {cost['summary']}")] if cost else [])


def lead_line(st: Status) -> Text | None:
    """The --signal-lead against the predicted emergency save, with the margin left."""
    lr = st.lead
    if lr is None or lr.predicted_save_s is None:
        return None
    amount = f" of {size(lr.predicted_bytes)}" if lr.predicted_bytes else ""
    text = f"lead: predicted emergency save{amount} {lr.predicted_save_s:.1f} s, needs --signal-lead >= {lr.required_s:.0f} s"
    if lr.lead_s is None:
        return Text(text + " (the lead in force is not logged: submit logs it)", style="dim")
    ok = (lr.margin_s or 0) >= 0
    return Text(f"{text}; --signal-lead {lr.lead_s} s: margin {lr.margin_s:+.0f} s", style="" if ok else "yellow")


def writer_line(st: Status) -> Text | None:
    w = st.writer
    if not w:
        return None
    text = "write path: " + (f"last save {w['last_save']}" if w.get("last_save") else "no save logged")
    if w.get("belief_line"):  # checkpoint.bandit.describe: path -> speed, age, saves; * the best
        text += f"; belief here: {w['belief_line']}"
    elif w.get("strategy"):
        text += f"; {w.get('source')} here: {w['strategy']}"
    if isinstance(w.get("last_breakdown"), dict):  # train.breakdown: where that save's seconds went
        text += f"; that save: {describe_breakdown(w['last_breakdown'])}"
    return Text(text, style="dim")


def status_view(st: Status, limit: int = 20, height: int | None = None) -> RenderableType:
    """The whole status screen as one renderable (also what `--watch` refreshes): the headline,
    problems, the checkpoints, then the save interval and the history. With `height` (watch),
    the checkpoint rows and history are cut to fit the terminal, checkpoints first."""
    title = Text.assemble(("slurmresume status ", "bold"), (st.root, "bold blue"))
    title.no_wrap, title.overflow = True, "ellipsis"
    parts: list[RenderableType] = [title]
    if st.verdict is not None:
        parts += headline_view(st)
    notes = [Text(f"problem: {m}", style="red") for m in st.problems]
    notes += [Text(f"warning: {m}", style="yellow") for m in st.warnings]
    if st.slurm.get("note") and (st.job.job_id or not st.slurm.get("available")):
        notes.append(Text(st.slurm["note"], style="dim"))
    parts += notes
    parts += [line for line in (lead_line(st), writer_line(st), mirror_line(st)) if line is not None]
    if height is not None:  # one line each, so that the budget below holds
        for part in parts:
            if isinstance(part, Text):
                part.no_wrap, part.overflow = True, "ellipsis"
        room = max(3, height - len(parts) - 6)
        parts.append(_checkpoint_table(st, min(limit or room, room)))
        left = height - len(parts) - min(len(st.checkpoints), room) - 8
        if st.history and left >= 3:
            parts.append(_history_table(st.history[-left:]))
        return Group(*parts)
    parts.append(_checkpoint_table(st, limit))
    parts += hang_view(st)
    if st.interval is not None:
        parts.append(interval_view(st.interval))
    if st.history:
        parts.append(_history_table(st.history))
    return Group(*parts)


def mirror_line(st: Status) -> Text | None:
    """The bucket asked now: newest there against newest here, uploads in flight (None: not asked)."""
    m = st.mirror
    if m is None or m.get("error"):
        return None
    here, there = m.get("newest_local"), m.get("newest_in_bucket")
    return Text(f"mirror {m['url']}: newest committed there {there if there is not None else 'none'}, here "
                f"{here if here is not None else 'none'}; uploads in flight: {m.get('uploads_in_flight')}",
                style="yellow" if m.get("behind") else "dim")


RANK_ROWS = 8  # ranks shown: the stragglers, then the longest silent (a 512-rank job fits a screen)


def hang_view(st: Status) -> list[RenderableType]:
    """Per rank: last step, its age, phase, step-time median and p99 (the stragglers and the
    longest silent first); the hang watch's budgets; the last hang and where its stacks are."""
    out: list[RenderableType] = []
    view = st.ranks
    if view is not None and view.get("ranks"):
        rows = view["ranks"]
        order = sorted(rows, key=lambda r: (int(r) not in view["stragglers"], -(rows[r].get("age_s") or 0), int(r)))
        out.append(Text(f"hang watch: {view.get('budgets')}", style="dim"))
        table = Table(box=None)
        for col in ("rank", "last step", "age", "phase", "median step", "p99 step", ""):
            table.add_column(col, justify="right" if col in ("rank", "last step") else "left")
        for r in order[:RANK_ROWS]:
            row = rows[r]
            note = f"straggler (> {100 * view['straggler_margin']:.0f}% slower)" if int(r) in view["stragglers"] else ""
            table.add_row(r, str(row.get("step")), _secs(row.get("age_s")), str(row.get("phase")),
                          _secs(row.get("median_s")), _secs(row.get("p99_s")), Text(note, style="yellow"))
        out.append(table)
        if len(order) > RANK_ROWS:
            out.append(Text(f"... {len(order) - RANK_ROWS} more ranks (slurmresume status --json)", style="dim"))
    hang = st.last_hang
    if hang is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(hang.get("time") or 0)))
        out.append(Text(f"last hang ({hang.get('hangs')} in all): {when}, rank(s) {hang.get('ranks')} silent "
                        f"{_secs(hang.get('silent_s'))} in {hang.get('phase')} after step {hang.get('step')}; stacks of "
                        f"every rank in {hang.get('dump_dir')}", style="yellow"))
    return out


def _secs(x: Any) -> str:
    """Step times need milliseconds; ages and hangs do not."""
    if not isinstance(x, (int, float)):
        return "?"
    return f"{1000 * x:.0f}ms" if x < 1 else f"{x:.1f}s" if x < 60 else format_duration(x)


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.2g}%" if x < 0.01 else f"{100 * x:.1f}%"


MIN_SAVES_FOR_AUTO = 3  # Young/Daly from fewer saves is noise
MIN_INTERRUPTIONS = 2  # one failure is not a rate
MIN_RUNTIME_S = 600.0  # nor are a few seconds of running


def interval_view(iv: IntervalSummary) -> RenderableType:
    """The save interval and, once there is enough history to mean something, what auto would
    choose, the failure rate and the expected loss. Numbers from too few events are not shown."""
    fd = format_duration
    first = (f"save interval: {fd(iv.current_s)} ({iv.source})" if iv.current_s is not None
             else "save interval: none observed yet")
    if iv.auto_s is not None and iv.saves >= MIN_SAVES_FOR_AUTO:
        first += f"; auto would choose {fd(iv.auto_s)} (Young/Daly, within {fd(iv.min_s)}..{fd(iv.max_s)})"
    cost = (f"save cost {iv.save_cost_s:.2f} s (median of the last {min(iv.saves, RECENT_SAVES)} saves)"
            if iv.save_cost_s is not None else "save cost unknown (no save yet)")
    second = cost  # the speed is in the headline
    enough = iv.interruptions >= MIN_INTERRUPTIONS and iv.runtime_s >= MIN_RUNTIME_S
    if enough and iv.mtbf_s:
        second += (f"; {iv.interruptions} unwarned interruption(s) in {fd(iv.runtime_s)} of running "
                   f"(MTBF {fd(iv.mtbf_s)})")
    elif iv.interruptions:
        second += f"; {iv.interruptions} unwarned interruption(s) so far"
    lines = [Text(first), Text(second, style="dim")]
    loss = iv.expected_loss
    if (loss is not None and loss["total"] is not None and enough and iv.saves >= MIN_SAVES_FOR_AUTO
            and loss["total"] <= 1):
        lines.append(Text(f"expected time lost at {fd(loss['interval_s'])}: {_pct(loss['saves'])} saving, "
                          f"{_pct(loss['failures'])} redoing work, total {_pct(loss['total'])}", style="dim"))
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
    for col in ("step", "state", "age", "size", "ranks", "checksum", "metrics"):
        t.add_column(col, justify="right" if col in ("step", "size", "ranks", "age") else "left",
                     no_wrap=col != "metrics", overflow="fold", min_width=12 if col == "metrics" else None)
    for r in shown:
        state = Text(r.state.replace("_", " "), style=_STATE[r.state])
        for flag, on in (("newest", r.newest), ("best", r.best)):
            if on:
                state.append(f", {flag}", style="bold")
        checksum = {None: "-", True: "ok", False: "FAILED"}[r.verified]
        t.add_row(str(r.step), state, format_duration(r.age_seconds),
                  size(r.bytes), str(r.shards or "-"), checksum, metrics_text(r.metrics))
    hidden = len(st.checkpoints) - len(shown) + st.omitted
    if not hidden:
        return t
    return Group(t, Text(f"... {hidden} older checkpoint director{'y' if hidden == 1 else 'ies'} not shown "
                         f"(--limit 0 shows all)", style="yellow"))


def print_status(st: Status, limit: int = 20) -> None:
    console().print(status_view(st, limit))


def watch(compute: Callable[[], Status], interval: float, limit: int = 20) -> None:
    """Redraw the status every `interval` seconds until Ctrl-C. Into a pipe or a file (no
    terminal to redraw), print one snapshot per interval, each flushed as it is printed, so
    `status --watch 10 | tee` shows them as they come and `timeout` loses none."""
    out = console()
    if not out.is_terminal:
        try:
            while True:
                out.print(status_view(compute(), limit))
                out.print()
                out.file.flush()
                time.sleep(interval)
        except KeyboardInterrupt:
            pass
        return
    try:
        with Live(console=console(), auto_refresh=False) as live:
            while True:
                live.update(status_view(compute(), limit, height=live.console.height), refresh=True)
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
        if r.unreadable:  # not checked, not corrupt: this version cannot read it
            out.print(Text.assemble(("NEWER ", "bold yellow"), f"step {r.step}  {r.path}"))
        else:
            out.print(Text.assemble(("FAIL  ", "bold red"), f"step {r.step}  {r.path}"))
        for p in r.problems:
            out.print(f"      {p}")


def _num(v: Any) -> str:
    return "-" if v is None else str(v) if isinstance(v, numbers.Integral) else f"{float(v):.4g}"


def _count(n: int) -> Text:
    return Text(str(n), style="bold red" if n else "")


def inspect_view(r: CheckpointReport, width: int = 200) -> RenderableType:
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
    narrow = r.stats_computed and width < NARROW_STATS
    parts.append(_tensor_lines(r) if narrow else _tensor_table(r))
    return Group(*parts)


NARROW_STATS = 110  # below this many columns, each tensor's statistics go on a line under its name


def _tensor_lines(r: CheckpointReport) -> RenderableType:
    """`inspect --tensors` on a narrow terminal: the full name on one line, its numbers indented
    below, so names stay readable instead of being folded into a column."""
    lines: list[RenderableType] = [Text("tensors", style="italic")]
    for x in r.tensors:
        rank = f" (rank {x.rank})" if r.world_size > 1 else ""
        lines.append(Text(x.name + rank, style="bold"))
        shape = "x".join(map(str, x.shape)) or "scalar"
        text = Text(f"    {x.dtype} {shape}, {size(x.bytes)}")
        if x.stats is not None:
            st = x.stats
            text.append(f"; min {_num(st.min)}, max {_num(st.max)}, mean {_num(st.mean)}")
            for label, n in (("NaN", st.nan_count), ("Inf", st.inf_count)):
                if n:
                    text.append(f", {n} {label}", style="bold red")
        lines.append(text)
    return Group(*lines)


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
    out = console()
    out.print(inspect_view(report, out.width))


_CHECK = {"ok": ("ok  ", "green"), "warn": ("warn", "yellow"), "fail": ("FAIL", "bold red")}


def print_doctor(checks: Sequence[Any]) -> None:
    """One line per check (status, name, finding), and an indented `fix:` line when there is one."""
    out = console()
    for c in checks:
        tag, style = _CHECK[c.status]
        out.print(Text.assemble((tag, style), f"  {c.name}: {c.message}"))
        if c.fix and c.status != "ok":
            out.print(Text(f"        fix: {c.fix}", style="dim" if c.status == "warn" else ""))
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    out.print(Text(f"{len(checks)} checks: {fails} failed, {warns} warnings",
                   style="bold red" if fails else "yellow" if warns else "green"))

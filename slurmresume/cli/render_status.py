"""The status screen: the headline, the problem and warning lines, the checkpoint and history
tables, printed once or redrawn (`watch`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..duration import format_duration
from ..tools.failures import NOT_RESTARTED
from ..tools.status import Status
from ..train.breakdown import describe as describe_breakdown
from .render_base import console, event_details, metrics_text, size, when
from .render_sections import hang_view, interval_view

_STATE = {"complete": "green", "corrupt": "bold red", "being_written": "cyan", "incomplete": "yellow",
          "unreadable": "bold yellow"}

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


FAILURES_SHOWN = 5  # the newest unwarned failures on the screen; --json has them all


def failure_lines(st: Status) -> list[Text]:
    """One line per unwarned failure (the newest FAILURES_SHOWN): where it happened, what the
    survivors' failure save did, and what it cost the restart. None without a failure."""
    shown = st.failures[-FAILURES_SHOWN:]
    out = [Text(f"unwarned failures: {len(st.failures)} (the newest {len(shown)} below; "
                "all in status --json)" if len(shown) < len(st.failures) else
                f"unwarned failures: {len(st.failures)}", style="bold")] if shown else []
    for f in shown:
        ok = f["save"] == "committed" and (f["repeated"] or 0) <= 1
        out.append(Text(f"  {failure_text(f)}", style="" if ok else "yellow"))
    return out


def failure_text(f: dict[str, Any]) -> str:
    """'failure at step 25 (rank 2 died): failure save committed step 25 (rank 0, 0.41 s); resumed
    from step 25: 0 steps repeated, first step 3.2 s after the failure'."""
    what = "hang" if f["kind"] == "hang" else "failure"
    head = f"{what} at step {f['step']}" if f["step"] is not None else f"{what} (step not known)"
    dead = f["dead"]
    if dead:
        ranks = ", ".join(map(str, dead))
        head += f" (rank{'s' if len(dead) > 1 else ''} {ranks} {'hung' if what == 'hang' else 'died'}"
        lasts = {s for s in f["dead_steps"].values()}
        head += (f", last at step {lasts.pop()})" if len(lasts) == 1 and f["step"] not in lasts else ")")
    if f["save"] == "committed":
        save = f"failure save committed step {f['save_step']}" + (
            f" (rank {f['save_writer']}, {f['save_s']:.2f} s)" if f["save_s"] is not None else "")
    elif f["save"] == "refused":
        save = "failure save refused: missing " + "; ".join(f["missing"])
    elif f["save"] == "failed":
        save = f"failure save of step {f['save_step']} failed: {f['error']}"
    else:
        save = "no failure save"
    return f"{head}: {save}; {_restart_text(f)}"


def _restart_text(f: dict[str, Any]) -> str:
    repeated = "" if f["repeated"] is None else f"{f['repeated']} step{'' if f['repeated'] == 1 else 's'} repeated"
    tier = (f" ({f['resumed_tier']} tier" + (f", restored in {f['restore_s']:.2f} s" if f.get("restore_s") is not None
                                               else "") + ")") if f.get("resumed_tier") else ""
    if f["to_first_step_s"] is not None:
        return (f"resumed from step {f['resumed_from']}{tier}: " + (f"{repeated}, " if repeated else "")
                + f"first step {f['to_first_step_s']:.1f} s after the failure")
    if f["action"] in NOT_RESTARTED:
        return f"not restarted ({f['action'].replace('_', ' ')})"
    if f["resumed_from"] is not None:
        return f"restored step {f['resumed_from']} ({repeated}), no step since"
    return "not resumed yet"


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
    parts += failure_lines(st)
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

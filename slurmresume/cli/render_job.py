"""Rendering for the job commands (submit, drill)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from ..job.submitflow import SubmitResult

console = Console()


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def print_local_preview(torchrun: list[str], ckpt_dir: Path) -> None:
    """`submit --local --dry-run`: what a local run would start, as plain lines to copy."""
    print("# local run (dry run: nothing was run, nothing written)")
    print(f"# checkpoint root: {shlex.quote(str(ckpt_dir))}")
    print("# torchrun command, restarted from the newest checkpoint after each warning signal:")
    print(shlex.join(torchrun))


def print_submitted(job_id: str, log_dir: Path, script: str | None, torchrun: list[str], ckpt_dir: Path) -> None:
    if script is not None:
        # Plain prints: the script must be copyable exactly, never wrapped to the terminal.
        print("# sbatch script (dry run, nothing submitted):")
        print(script, end="")
        print("# per-node torchrun command:")
        print(shlex.join(torchrun))
        return
    console.print(f"submitted job [bold]{job_id}[/bold]")
    console.print(f"logs:        {log_dir}", markup=False)
    console.print(f"checkpoints: {ckpt_dir}", markup=False)
    # quoted: the line is meant to be pasted into a shell, and paths have spaces
    console.print(f"watch it:    slurmresume status --ckpt-dir {shlex.quote(str(ckpt_dir))} --job {job_id}", markup=False)


def print_submit_result(result: SubmitResult, *, json_out: bool) -> None:
    """What `submit` prints of job.submitflow's result; a Ctrl-C'd local run ends in exit 130
    (`submit --local && next` must not go on)."""
    from ..job.submitflow import Interrupted, JobPreview, LocalPreview, LocalRun

    if isinstance(result, LocalPreview):
        if json_out:
            print_json({"job_id": None, "local": True, "torchrun": result.torchrun, "ckpt_dir": str(result.ckpt_dir),
                        "dry_run": True})
        else:
            print_local_preview(result.torchrun, result.ckpt_dir)
    elif isinstance(result, Interrupted):
        if json_out:
            print_json(result.record)
        typer.echo(result.line, err=True)
        raise typer.Exit(130)
    elif isinstance(result, LocalRun):
        if json_out:
            print_json(result.record)
        else:
            typer.echo(f"local run {result.record['action']}: {result.record['reason']}")
    else:
        dry_run = isinstance(result, JobPreview)
        sub = result.sub
        if json_out:
            print_json({"job_id": sub.job_id or None, "log_dir": str(sub.log_dir), "sbatch_script": sub.sbatch_script,
                        "torchrun": sub.torchrun, "ckpt_dir": str(result.ckpt_dir), "dry_run": dry_run})
        else:
            print_submitted(sub.job_id, sub.log_dir, sub.sbatch_script if dry_run else None, sub.torchrun,
                            result.ckpt_dir)


def print_drill(report: Any, next_command: str = "") -> None:
    table = Table(title="slurmresume drill", show_header=False)
    table.add_row("steps", str(report.steps))
    if report.hangs_planned:
        table.add_row("hangs planned (rank@step)", ", ".join(f"{r}@{s}" for r, s in report.hangs_planned))
        for h, r in zip(report.hangs, report.recoveries + [None] * len(report.hangs), strict=False):
            table.add_row("hang detected", f"rank(s) {h.get('ranks')} after step {h.get('step')}: "
                          f"{h.get('detect_latency_s')} s after the last heartbeat, stacks in {h.get('dump_s')} s "
                          f"-> {h.get('dump_dir')}" + (f"; first step {r['seconds']} s after the kill" if r else ""))
    else:
        table.add_row("warnings planned at", ", ".join(map(str, report.planned)))
        table.add_row("saves after a warning", ", ".join(map(str, report.saved_steps)) or "none")
        table.add_row("restarts", str(report.preemptions))
    table.add_row("reference", str(report.reference))
    table.add_row("resumed", str(report.resumed))
    if getattr(report, "mirror", None):
        table.add_row("mirror (scratch)", report.mirror)
    console.print(table, markup=False)
    notes = getattr(report, "notes", [])
    if report.ok:
        what = "restarted after every hang and " if report.hangs_planned else ""
        where = " where compared (NOTE below)" if notes else ""
        console.print(f"[green]PASS[/green]: the run {what}ended bitwise equal to the uninterrupted one, "
                      f"every restart resumed the committed step, and the metrics agreed at every step{where}")
        _print_notes(notes)
        if report.workdir is not None:
            console.print(f"runs:  {report.workdir}/uninterrupted and {report.workdir}/preempted "
                          f"(slurmresume status --ckpt-dir {report.workdir}/preempted)", markup=False)
        if next_command:
            console.print(f"next:  {next_command}", markup=False)
        return
    for problem in [*report.resume_problems, *report.hang_problems]:
        console.print(f"[red]FAIL[/red]: {escape(problem)}", markup=True, highlight=False)
    if not report.hangs_planned and report.preemptions == 0:
        console.print("[red]FAIL[/red]: no warning led to a save and restart (is ckpt.step() called every step?)")
    elif not report.hangs_planned and report.missed:
        console.print(f"[red]FAIL[/red]: {report.missed} of {len(report.planned)} warnings led to no save and "
                      "restart (is ckpt.step() called after every step, up to the last?)")
    # every differing top-level key (or RNG stream), causes first; one line each, however many
    by_top: dict[str, list[Any]] = {}
    for d in report.differences:
        by_top.setdefault(d.top, []).append(d)
    for top, diffs in by_top.items():
        d = diffs[0]
        more = f" (+{len(diffs) - 1} more under '{top}')" if len(diffs) > 1 else ""
        label = "[yellow]NOTE[/yellow]" if d.note.startswith("never seeded") else "[red]FAIL[/red]"
        console.print(f"{label}: {d}{more}", markup=True, highlight=False)
    if report.metric_difference is not None:  # after the state: a differing state explains it
        console.print(f"[red]FAIL[/red]: {escape(str(report.metric_difference))}", markup=True, highlight=False)
    _print_notes(notes)


def _print_notes(notes: list[str]) -> None:
    for note in notes:
        console.print(f"[yellow]NOTE[/yellow]: {escape(note)}", markup=True, highlight=False)

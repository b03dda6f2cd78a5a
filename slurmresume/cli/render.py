"""Rich rendering of status, prune plans and verify results: with the other render*.py, the only rich importers.

Functions here take computed data (status.Status, retention.PrunePlan, ...) and print it; they
decide nothing. Width comes from the terminal (or $COLUMNS, which tests fix).

Here: prune plans and results, verify results, doctor's checks. Beside it, re-exported from here:
`render_base` (console, progress bar, sizes, times), `render_status` (the status screen, `watch`),
`render_sections` (its rank and save-interval sections), `render_inspect` (`inspect`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich import box
from rich.table import Table
from rich.text import Text

from ..retention import PrunePlan, PruneResult
from ..tools.status import VerifyResult
from .render_base import console as console
from .render_base import event_details as event_details
from .render_base import metrics_text as metrics_text
from .render_base import progress as progress
from .render_base import size as size
from .render_base import when as when
from .render_inspect import NARROW_STATS as NARROW_STATS
from .render_inspect import inspect_view as inspect_view
from .render_inspect import print_inspect as print_inspect
from .render_sections import MIN_INTERRUPTIONS as MIN_INTERRUPTIONS
from .render_sections import MIN_RUNTIME_S as MIN_RUNTIME_S
from .render_sections import MIN_SAVES_FOR_AUTO as MIN_SAVES_FOR_AUTO
from .render_sections import RANK_ROWS as RANK_ROWS
from .render_sections import hang_view as hang_view
from .render_sections import interval_view as interval_view
from .render_status import headline_view as headline_view
from .render_status import lead_line as lead_line
from .render_status import mirror_line as mirror_line
from .render_status import print_status as print_status
from .render_status import status_view as status_view
from .render_status import watch as watch
from .render_status import writer_line as writer_line


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

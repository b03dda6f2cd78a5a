"""Two sections of the status screen: the hang watch's view of the ranks (and the last hang),
and the save interval with what it costs."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ..duration import format_duration
from ..tools.status import Status
from ..train.savepolicy import RECENT_SAVES, IntervalSummary

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
            phase = str(row.get("phase")) + (f" ({row['moving_bytes'] / 1e9:.2f} GB, budget {row.get('budget_s')} s)"
                                              if isinstance(row.get("moving_bytes"), int) and row["moving_bytes"] > 0
                                              else "")
            table.add_row(r, str(row.get("step")), _secs(row.get("age_s")), phase,
                          _secs(row.get("median_s")), _secs(row.get("p99_s")), Text(note, style="yellow"))
        out.append(table)
        for host, mem in sorted((view.get("memory") or {}).items()):  # the memory tier (issue 49), per node
            copies = "".join(f"; node {n}'s snapshot of step {step} (peer copy)"
                             for n, step in sorted((mem.get("replicas") or {}).items()))
            out.append(Text(f"memory tier on {host}: newest snapshot step {mem.get('step')}, "
                            f"{(mem.get('bytes') or 0) / 1e6:.1f} MB held{copies}", style="dim"))
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

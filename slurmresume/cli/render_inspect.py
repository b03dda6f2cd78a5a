"""`inspect`'s view: a checkpoint's summary, its state keys and one row (or, on a narrow
terminal, a few lines) per tensor."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .render_base import console, metrics_text, size, when

if TYPE_CHECKING:
    from ..tools.inspect import CheckpointReport


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

"""`slurmresume inspect`, registered on the app in cli.py: options -> inspect.py -> render or JSON."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from .cli import app, handle_errors
from .options import CkptDir, JsonOut, resolve_root


@app.command()
@handle_errors
def inspect(
    target: Annotated[str, typer.Argument(
        metavar="STEP_OR_PATH", help="A step number under --ckpt-dir, 'latest' (the newest complete "
        "checkpoint there), or the path of a step directory such as runs/exp1/step_000001200.")],
    ckpt_dir: CkptDir = None,
    tensors: Annotated[bool, typer.Option(
        "--tensors", help="Also read every tensor's values for min, max, mean and NaN/Inf counts "
        "(streams each shard through a small buffer; reads every byte).")] = False,
    as_json: JsonOut = False,
) -> None:
    """What a checkpoint holds: step, ranks, metrics, state keys and every tensor.

    Lists each tensor's dtype, shape and size from the manifest and the shard headers; with
    --tensors also its min/max/mean and NaN/Inf counts, in bounded memory. Only committed
    checkpoints: an incomplete or corrupt directory exits 1 saying why. Reads only.
    Example: slurmresume inspect latest --tensors --ckpt-dir runs/exp1
    """
    from . import _render
    from .inspect import inspect_checkpoint, locate, needs_root

    target = target.strip()
    root = resolve_root(ckpt_dir) if needs_root(target) else None
    step, path = locate(target, root)
    with _render.progress("reading tensors") as bar:
        report = inspect_checkpoint(step, path, tensors=tensors, progress=bar)
    if as_json:
        typer.echo(json.dumps(report.to_json(), indent=2, allow_nan=False))
    else:
        _render.print_inspect(report)

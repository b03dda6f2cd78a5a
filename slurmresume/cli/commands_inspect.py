"""`slurmresume inspect`, registered on the app when cli/__init__.py imports it: options -> inspect.py -> render or JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from ..storage import is_bucket
from .app import app, handle_errors
from .options import CkptDir, JsonOut, configured_root, resolve_root
from .shared import emit_json

if TYPE_CHECKING:
    from pathlib import Path

    from ..tools.inspect import CheckpointReport


@app.command()
@handle_errors
def inspect(
    target: Annotated[str, typer.Argument(
        metavar="STEP|PATH|URL", help="A step number under --ckpt-dir, 'latest' (the newest complete "
        "checkpoint there), the path of a step directory such as runs/exp1/step_000001200, or a step "
        "URL such as s3://bucket/exp1/step_000001200.")],
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
    On an s3:// root (or a step URL as printed by `latest`), the same report: the marker,
    manifest and shard headers are read from the bucket; --tensors first downloads the step
    into $TMPDIR, every shard checked against its manifest, and removes it afterwards.
    Example: slurmresume inspect latest --tensors --ckpt-dir runs/exp1
    """
    from ..tools.inspect import inspect_checkpoint, locate, needs_root
    from . import render as _render

    target = target.strip()
    if is_bucket(target) or (needs_root(target) and is_bucket(ckpt_dir or configured_root())):
        report = _inspect_s3(target, ckpt_dir or configured_root(), tensors)
    else:
        root = resolve_root(ckpt_dir, "inspect") if needs_root(target) else None
        step, path = locate(target, root)
        with _render.progress("reading tensors") as bar:
            report = inspect_checkpoint(step, path, tensors=tensors, progress=bar)
    if as_json:
        emit_json(report.to_json())
    else:
        _render.print_inspect(report)


def _inspect_s3(target: str, root: Path | None, tensors: bool) -> CheckpointReport:
    """The report of a bucket step, read from a temporary local copy (headers only unless
    `tensors`); `path` is the step's s3:// URL."""
    from ..mirror.fetch import local_copy, locate
    from ..tools.inspect import inspect_checkpoint
    from . import render as _render

    loc, which = locate(target, root)
    with local_copy(loc, which, headers_only=not tensors) as copy, _render.progress("reading tensors") as bar:
        report = inspect_checkpoint(copy.step, copy.path, tensors=tensors, progress=bar)
    report.path = copy.url
    return report

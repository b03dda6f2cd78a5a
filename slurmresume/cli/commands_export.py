"""`slurmresume export`: a model's weights from a committed checkpoint as one safetensors file."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ..errors import ConfigError, NoCheckpointError
from ..storage import DirRoot, is_bucket
from .app import app, handle_errors
from .options import CkptDir, JsonOut, configured_root, resolve_root
from .shared import emit_json, export_json


def resolve_step_dir(which: str, ckpt_dir: Path | None) -> Path:
    """STEP, 'latest', or a path to a step directory -> a step directory path."""
    from ..checkpoint.layout import parse_step_dir, step_dir_name

    path = Path(which).expanduser()
    if parse_step_dir(path.name) is not None and path.is_dir():
        return path
    root = resolve_root(ckpt_dir, "export")
    if which == "latest":
        info = DirRoot(root).latest()
        if info is None:
            raise NoCheckpointError(f"no complete checkpoint under {root}")
        return info.path
    if not which.isdigit():
        raise ConfigError(f"{which!r} is not a step number, 'latest', or a step directory")
    return root / step_dir_name(int(which))


@app.command()
@handle_errors
def export(
    which: Annotated[str, typer.Argument(metavar="STEP|PATH|URL", help="A step number under --ckpt-dir, 'latest' (the newest complete checkpoint there), the path of a step directory, or a step URL (s3://bucket/run/step_000001200).")] = "latest",
    out: Annotated[Path, typer.Option("--out", "-o", help="The .safetensors file to write.")] = Path("model.safetensors"),
    only: Annotated[str, typer.Option(help="Which state key to export (the one holding the model).")] = "model",
    rank: Annotated[int, typer.Option(help="Whose shard to read for per-rank tensors (data-parallel replicas are identical; DTensors are consolidated from every rank).")] = 0,
    ckpt_dir: CkptDir = None,
    as_json: JsonOut = False,
) -> None:
    """Write a committed checkpoint's model weights to one safetensors file.

    The file loads with `safetensors.torch.load_file` and then `model.load_state_dict`. Tensors
    are streamed one at a time, so memory stays near the largest tensor.

    On an s3:// root (or a step URL as printed by `latest`), the step is first downloaded
    beside --out (a hidden temporary directory, removed afterwards), every shard checked
    against its manifest before a byte is read; the file then is the same as from a local root.
    --json prints what was written (step, file, tensors, bytes) as one JSON object.

    Example: slurmresume export latest --out final.safetensors --ckpt-dir /ckpt/run1
    """
    from ..checkpoint.store import inspect_dir
    from ..tools.export import export_model

    out = out.expanduser().absolute()
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory: give a file name, e.g. --out {out / 'model.safetensors'}")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: directory {out.parent} does not exist: create it first")
    root = ckpt_dir or (configured_root() if which == "latest" or which.isdigit() else None)
    if is_bucket(which) or ((which == "latest" or which.isdigit()) and is_bucket(root)):
        summary = _export_s3(which, root, out, only, rank)
    else:
        step_dir = resolve_step_dir(which, ckpt_dir)
        from ..checkpoint.layout import parse_step_dir

        info = inspect_dir(parse_step_dir(step_dir.name) or 0, step_dir)
        if not info.complete:
            raise ConfigError(f"{step_dir} is not a complete checkpoint: {info.problem}")
        from . import render as _render

        with _render.progress("exporting tensors") as bar:
            summary = export_model(step_dir, out, only=only, rank=rank, progress=bar)
    if as_json:
        emit_json(export_json(summary))
    else:
        typer.echo(f"wrote {summary['out']}: {summary['tensors']} tensors, {summary['bytes']} bytes from step {summary['step']}")


def _export_s3(which: str, root: Path | None, out: Path, only: str, rank: int) -> dict[str, Any]:
    """Export from a bucket step: a verified download beside `out`, then the local export."""
    from ..mirror.fetch import local_copy, locate
    from ..tools.export import export_model
    from . import render as _render

    loc, step = locate(which, root)
    with (local_copy(loc, step, headers_only=False, parent=out.parent) as copy,
          _render.progress("exporting tensors") as bar):
        return export_model(copy.path, out, only=only, rank=rank, progress=bar, source=copy.url)

"""`slurmresume doctor`, registered on the app when cli/__init__.py imports it: options -> doctor.run_doctor -> render."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..errors import ConfigError
from .app import app, handle_errors
from .options import JsonOut, ckpt_dir_option, configured_root, root_hint
from .shared import emit_json


@app.command()
@handle_errors
def doctor(
    script: Annotated[Path | None, typer.Argument(
        metavar="TRAIN_SCRIPT", help="Training script to check statically (creates a Checkpointer, restores, calls "
        "ckpt.step() in its loop).", show_default="none: the script checks are skipped")] = None,
    ckpt_dir: Annotated[Path | None, ckpt_dir_option(
        help="Checkpoint root: its measured save times and filesystem are checked.",
        default="$SLURMRESUME_CKPT_DIR, else ckpt-dir in [tool.slurmresume]; none: those checks are skipped")] = None,
    signal_lead: Annotated[int, typer.Option(
        "--signal-lead", help="The --signal-lead you submit with (seconds).", min=1)] = 120,
    partition: Annotated[str | None, typer.Option(
        "--partition", "-p", help="Partition you submit to.", show_default="the cluster's default partition")] = None,
    as_json: JsonOut = False,
) -> None:
    """Will preemption handling work on this cluster, for this root and script?

    Checks `scontrol show config` (PreemptType/PreemptMode, preempt_send_user_signal,
    JobRequeue, ProctrackType, KillWait), the partition's GraceTime and MaxTime, whether
    --signal-lead covers the root's measured save times, whether the script calls
    ckpt.step(), the root's filesystem and free space, and the Slurm version's known limits.
    Each check says ok / warn / fail and what to change. Exit 1 when any check fails.

    Example: slurmresume doctor train.py --ckpt-dir /ckpt/run1 --partition gpu
    """
    from ..tools.doctor import run_doctor
    from . import render as _render

    root = ckpt_dir if ckpt_dir is not None and str(ckpt_dir) else configured_root()
    root = root.expanduser().absolute() if root is not None else None
    if script is not None and script.is_dir():
        raise ConfigError(root_hint("doctor", str(script), "a training script"))
    if script is not None and not script.is_file():
        raise ConfigError(f"training script {script} not found: pass the path of a .py file")
    checks = run_doctor(root, script, signal_lead, partition)
    if as_json:
        emit_json({"schema": "slurmresume.tools.doctor/1", "checks": [c.__dict__ for c in checks],
                   "ok": not any(c.status == "fail" for c in checks)})
    else:
        _render.print_doctor(checks)
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)

"""What the job commands (submit, drill) make of what was typed, beyond the JobSpec's own checks:
the typed options that become a JobSpec (`SpecOptions`; the ones that steer `submit` itself are
job.submitflow's `SubmitFlags`), `--python` looked up on PATH, what `--local` cannot honour, and the `submit` line
a passing drill suggests (`next:`), which must work when pasted."""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import typer

from ..errors import ConfigError
from ..job.config import JobSpec, check_text
from .options import configured_root


@dataclass(frozen=True)
class SpecOptions:
    """The command-line options that become JobSpec fields, by name (None: not given, so the
    [tool.slurmresume] value or our default applies; `gres` becomes a --sbatch entry). `submit`
    builds one field by field, so a new option reaches the JobSpec only by being added here;
    every submit option is here or in job.submitflow.SubmitFlags (test_cli_help_consistency)."""

    ckpt_dir: Path | None = None
    nodes: int | None = None
    nproc_per_node: int | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    job_name: str | None = None
    signal: str | None = None
    signal_lead: int | None = None
    max_requeues: int | None = None
    max_failures: int | None = None
    hang_timeout: str | None = None
    hang_startup: float | None = None
    hang_busy: float | None = None
    hang_save: float | None = None
    hang_io_rate: float | None = None
    max_hangs: int | None = None
    gres: str | None = None
    setup: list[str] | None = None
    sbatch: list[str] | None = None
    rdzv_port: int | None = None
    python: str | None = None
    mirror: str | None = None
    snapshot_every: str | None = None

    def given(self) -> dict[str, Any]:
        """{field: value} of the options given (not None)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def find_python(value: str) -> str:
    """--python as typed: a bare name (python3) is looked up on PATH, as a shell would; a path is
    made absolute. The result is what every node runs."""
    check_text("--python", value)
    if "/" in value:
        return str(Path(value).expanduser().absolute())
    found = shutil.which(value)
    if found is None:
        raise ConfigError(f"--python {value} is not on PATH: give the path of the nodes' python, e.g. ~/venv/bin/python")
    return str(Path(found).absolute())


# What only a Slurm submission uses: a local run (one node, no allocation) ignores these.
_SLURM_ONLY = ("partition", "account", "qos", "constraint", "job_name", "time", "mem", "cpus_per_task", "sbatch",
               "setup", "rdzv_port", "signal_lead")


def refuse_local_ignored(spec: JobSpec, given: SpecOptions) -> None:
    """`--local`: refuse --nodes > 1 (it would change the world size the script sees); name on
    stderr the Slurm options given on the command line that a local run does not use."""
    if spec.nodes > 1:
        raise ConfigError(f"--local runs one node on this machine, so --nodes {spec.nodes} cannot apply: pass --nodes 1 "
                          "to try it here (more ranks: --nproc-per-node), or drop --local to submit to Slurm")
    named = [f"--{k.replace('_', '-')}" for k in _SLURM_ONLY if getattr(given, k) not in (None, [], ())]
    if named:
        verb = "applies" if len(named) == 1 else "apply"
        typer.echo(f"warning: --local runs here without Slurm: {', '.join(named)} {verb} only when submitted "
                   "(ignored here)", err=True)


def next_command(spec: JobSpec) -> str:
    """What to type after a PASS: the same script and arguments, submitted to Slurm, with a
    checkpoint root of its own (the configured ckpt-dir, else runs/<script name>; never the drill's
    scratch folder), so the line works when pasted."""
    root = ""
    if configured_root() is None:
        name = Path("runs") / spec.script.stem
        if name.absolute() == spec.ckpt_dir:
            name = Path("runs") / f"{spec.script.stem}-run"
        root = f" --ckpt-dir {shlex.quote(str(name))}"
    args = f" -- {shlex.join(spec.script_args)}" if spec.script_args else ""
    return f"slurmresume submit {shlex.quote(str(spec.script))}{root} --nproc-per-node {spec.procs}{args}"

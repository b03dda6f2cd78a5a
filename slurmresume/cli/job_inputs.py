"""What the job commands (submit, drill) make of what was typed, beyond the JobSpec's own checks:
`--python` looked up on PATH, what `--local` cannot honour, and the `submit` line a passing drill
suggests (`next:`), which must work when pasted."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

import typer

from ..errors import ConfigError
from ..job.config import JobSpec, check_text
from .options import configured_root


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


def refuse_local_ignored(spec: JobSpec, cli: dict[str, Any]) -> None:
    """`--local`: refuse --nodes > 1 (it would change the world size the script sees); name on
    stderr the Slurm options given on the command line that a local run does not use."""
    if spec.nodes > 1:
        raise ConfigError(f"--local runs one node on this machine, so --nodes {spec.nodes} cannot apply: pass --nodes 1 "
                          "to try it here (more ranks: --nproc-per-node), or drop --local to submit to Slurm")
    given = [f"--{k.replace('_', '-')}" for k in _SLURM_ONLY if cli.get(k) not in (None, [], ())]
    if given:
        verb = "applies" if len(given) == 1 else "apply"
        typer.echo(f"warning: --local runs here without Slurm: {', '.join(given)} {verb} only when submitted "
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

"""Options and helpers shared by the CLI command modules (no command lives here)."""

from __future__ import annotations

import os
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..checkpoint.layout import refuse_step_dir
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..storage import Root

ENV_ROOT = "SLURMRESUME_CKPT_DIR"


class Mode(str, Enum):
    min = "min"
    max = "max"


ROOT_FLAGS = ("--ckpt-dir", "-d")  # every command that takes a checkpoint root spells it so (test_cli_help_consistency)
ROOT_HELP = "Checkpoint root: the directory holding the step_* folders."
ROOT_DEFAULT = "$SLURMRESUME_CKPT_DIR, else ckpt-dir in [tool.slurmresume] of pyproject.toml"


def ckpt_dir_option(help: str = ROOT_HELP, default: str = ROOT_DEFAULT, envvar: str | None = ENV_ROOT) -> Any:
    """The one spelling of the checkpoint root, -d / --ckpt-dir, for every command that takes one;
    `help` and `default` (what --help shows as [default: ...]) say what this command does with it.
    `envvar`: None where the variable is not read (`submit` exports it to the script instead)."""
    return typer.Option(*ROOT_FLAGS, metavar="DIR", envvar=envvar, show_envvar=envvar is not None,
                        help=help, show_default=default)


CkptDir = Annotated[Path | None, ckpt_dir_option()]
JsonOut = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout instead of the text report.")]
ModeOpt = Annotated[Mode, typer.Option("--mode", help="Whether the lowest (min, e.g. loss) or highest "
                                       "(max, e.g. accuracy) metric value is best.")]


def root_hint(command: str, given: str, instead: str = "") -> str:
    """The one line for a checkpoint root given as an argument (`status DIR`): the root is
    -d / --ckpt-dir (only `latest` still takes it as an argument, for older scripts). `instead`:
    what the argument is for, if anything."""
    import shlex

    what = "a directory" if Path(given).expanduser().is_dir() else "an argument `" + command + "` does not take"
    return (f"{given} is {what}{', not ' + instead if instead else ''}: give the checkpoint root as -d DIR: "
            f"slurmresume {command} -d {shlex.quote(given)}")


def configured_root() -> Path | None:
    """`ckpt-dir` of [tool.slurmresume] (nearest pyproject.toml) or slurmresume.toml, if set."""
    from ..job.config import load_defaults

    value = load_defaults(Path.cwd()).get("ckpt_dir")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"ckpt-dir = {value!r} in [tool.slurmresume] must be a path string, e.g. \"runs/exp1\"")
    return Path(value)


def resolve_root(ckpt_dir: Path | None, command: str | None = None) -> Path:
    """The checkpoint root from --ckpt-dir, else $SLURMRESUME_CKPT_DIR, else `ckpt-dir` in
    [tool.slurmresume] / slurmresume.toml (what `submit` uses); it must be a directory, and not
    a step folder or inside one (`command` names the command in the hint)."""
    if ckpt_dir is None or str(ckpt_dir) == "":
        ckpt_dir = configured_root()
    if ckpt_dir is None:
        raise ConfigError(f"no checkpoint root: pass --ckpt-dir DIR, set {ENV_ROOT}, "
                          "or set ckpt-dir in [tool.slurmresume] of pyproject.toml")
    root = ckpt_dir.expanduser().absolute()
    refuse_step_dir(root, command)
    if not root.exists():
        raise ConfigError(f"checkpoint root {root} does not exist: check --ckpt-dir / {ENV_ROOT}")
    if not root.is_dir():
        raise ConfigError(f"checkpoint root {root} is not a directory: point --ckpt-dir at the run's directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise ConfigError(f"checkpoint root {root} is not readable by this user: check its permissions")
    return root


def open_ckpt_root(value: str | Path | None, command: str) -> Root:
    """-d/--ckpt-dir (or a command's ROOT argument) as a storage root: a bucket URL as given,
    else the directory `resolve_root` finds and checks (its defaults, its one-line refusals)."""
    from ..storage import open_root

    return open_root(value, resolve=lambda path: resolve_root(path, command))

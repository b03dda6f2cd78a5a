"""The `slurmresume` command. Commands are thin adapters over the library; `handle_errors` here
is the one place where domain errors become a one-line message and a non-zero exit code."""

from __future__ import annotations

import errno
import functools
import inspect
import sys
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from .errors import SlurmResumeError

F = TypeVar("F", bound=Callable[..., Any])

app = typer.Typer(
    name="slurmresume",
    help="Preemptible PyTorch training on Slurm: submit, watch, and manage checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


_OS_HINTS = {
    errno.EACCES: "check its owner and permissions (ls -ld), or choose another path",
    errno.EPERM: "check its owner and permissions (ls -ld), or choose another path",
    errno.EROFS: "the filesystem is read-only: choose a writable --ckpt-dir / --out",
    errno.ENOSPC: "the disk is full: free space (slurmresume prune --keep N) or choose another path",
    errno.EDQUOT: "your disk quota is exhausted: free space (slurmresume prune --keep N) or choose another path",
    errno.EISDIR: "it is a directory: give a file path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: fix the path",
    errno.ENOENT: "it does not exist: check the path",
}


def os_error_message(exc: OSError) -> str:
    """One line for an OSError the user can fix: what failed, on which path, and what to do."""
    what = exc.strerror or str(exc)
    where = f" {exc.filename}" if exc.filename else ""
    hint = _OS_HINTS.get(exc.errno or 0, "check the path and try again")
    return f"{what}:{where}: {hint}"


def handle_errors(fn: F) -> F:
    """Wrap a command: SlurmResumeError or an OSError (a path the user gave: permissions, a full
    or read-only disk) -> `error: <message>` on stderr and exit code 1, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SlurmResumeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
        except OSError as exc:
            typer.echo(f"error: {os_error_message(exc)}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


def _escape_help_markup() -> None:
    """Rich reads `[default: 1]` in a help string as a markup tag and drops it: escape every
    `[` of every option's and argument's help once, here, instead of in each string."""
    for cmd in app.registered_commands:
        if cmd.callback is None:
            continue
        hints = typing.get_type_hints(inspect.unwrap(cmd.callback), include_extras=True)
        for hint in hints.values():
            for info in getattr(hint, "__metadata__", ()):
                if isinstance(info, typer.models.ParameterInfo) and info.help and "\\[" not in info.help:
                    info.help = info.help.replace("[", "\\[")


from . import commands_ckpt, commands_doctor, commands_export, commands_inspect, commands_job  # noqa: E402,F401

_escape_help_markup()


def main() -> None:
    """The console script: usage errors (a bad option or value) are one line and exit 2."""
    import click

    try:
        code = app(standalone_mode=False)
    except click.UsageError as exc:
        cmd = exc.ctx.command_path if exc.ctx else "slurmresume"
        typer.echo(f"error: {exc.format_message()} (see `{cmd} --help`)", err=True)
        sys.exit(2)
    except click.ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except click.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

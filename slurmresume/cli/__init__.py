"""The `slurmresume` console script: the application of app.py with every command module
registered (importing them registers their commands), and usage errors as one line."""

from __future__ import annotations

import sys

import typer

from . import commands_ckpt, commands_doctor, commands_export, commands_inspect, commands_job  # noqa: F401
from .app import app, handle_errors, os_error_message

__all__ = ["app", "handle_errors", "main", "os_error_message"]


def _script_hint(exc: Exception) -> str | None:
    """An unknown option given to submit/drill is most often the script's own, put before `--`."""
    ctx = getattr(exc, "ctx", None)
    name = getattr(exc, "option_name", None)
    if name is None or ctx is None or ctx.command.name not in ("submit", "drill"):
        return None
    return (f"if {name} is your script's, script arguments go after `--`: "
            f"slurmresume {ctx.command.name} SCRIPT [OPTIONS] -- {name} ...; else see `{ctx.command_path} --help`")


def main() -> None:
    """The console script: usage errors (a bad option or value) are one line and exit 2."""
    try:  # typer >= 0.2x carries its own copy of click
        from typer._click.exceptions import ClickException, UsageError
    except ImportError:  # pragma: no cover
        from click.exceptions import ClickException, UsageError  # type: ignore[assignment]

    try:
        code = app(standalone_mode=False)
    except UsageError as exc:
        if not exc.format_message().strip() and exc.ctx is not None:  # no arguments: the help
            typer.echo(exc.ctx.get_help())
            sys.exit(2)
        cmd = exc.ctx.command_path if exc.ctx else "slurmresume"
        typer.echo(f"error: {exc.format_message()} ({_script_hint(exc) or f'see `{cmd} --help`'})", err=True)
        sys.exit(2)
    except ClickException as exc:
        typer.echo(f"error: {exc.format_message()}", err=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(130)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()

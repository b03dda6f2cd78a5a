"""The `slurmresume` command. Commands are thin adapters over the library; `handle_errors` here
is the one place where domain errors become a one-line message and a non-zero exit code."""

from __future__ import annotations

import functools
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


def handle_errors(fn: F) -> F:
    """Wrap a command: SlurmResumeError -> `error: <message>` on stderr and exit code 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except SlurmResumeError as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

    return wrapper  # type: ignore[return-value]


from . import commands_ckpt, commands_export, commands_inspect, commands_job  # noqa: E402,F401  (they register commands)


def main() -> None:
    app()


if __name__ == "__main__":
    main()

"""The `slurmresume` Typer application and the one place where domain errors become a one-line
message and a non-zero exit code (`handle_errors`). The command modules register themselves on
`app`; `cli/__init__.py` imports them, so nothing here imports a command back (no import cycle)."""

from __future__ import annotations

import errno
import functools
import inspect
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer

from ..errors import SlurmResumeError

F = TypeVar("F", bound=Callable[..., Any])

_OWN_LINE = ("Example:", "Exit codes:")  # a docstring line starting so keeps its own line


def reflow(text: str) -> str:
    """Pure: a docstring's paragraphs with their hard line breaks removed, so the terminal wraps
    them at its own width (Typer keeps the breaks of every paragraph but the first). A line
    starting with one of _OWN_LINE still starts a line; a paragraph starting with \\b is kept."""
    out = []
    for para in text.split("\n\n"):
        if para.startswith("\b"):
            out.append(para)
            continue
        lines = [line.strip() for line in para.strip("\n").split("\n")]
        out.append("".join(("\n" if i and line.startswith(_OWN_LINE) else " " if i else "") + line
                           for i, line in enumerate(lines)))
    return "\n\n".join(out)


class _Command(typer.core.TyperCommand):
    """Help as a terminal shows it: the docstring re-flowed to its width (`reflow`); every default
    in one style, `[default: ...]`: a literal one as Typer prints it, a described one (an option
    whose None means "the partition's", say) given as `show_default="the partition's"` and
    printed the same way, not as Typer's `[default: (the partition's)]`; no `<bool>` type on a
    flag (it takes no value). And Rich reads `[default: 1]` in a help string as a markup tag and
    drops it: escape the brackets of every option's and argument's help once, here."""

    panels: dict[str, tuple[str, ...]] = {}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.help:
            self.help = reflow(inspect.cleandoc(self.help))
        panel_of = {name: title for title, names in self.panels.items() for name in names}
        for p in self.params:
            if p.name in panel_of:
                p.rich_help_panel = panel_of[p.name]  # type: ignore[attr-defined]
            text = getattr(p, "help", None)
            described = getattr(p, "show_default", None)
            if isinstance(described, str):
                text = f"{text} [default: {described}]" if text else f"[default: {described}]"
                p.help = text  # type: ignore[attr-defined]
                p.show_default = False  # type: ignore[attr-defined]
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""  # Typer's rich help shows the metavar in place of the type
            if text and "[" in text and "\\[" not in text:
                p.help = text.replace("[", "\\[")  # type: ignore[attr-defined]

    def get_help_option(self, ctx: Any) -> Any:
        opt = super().get_help_option(ctx)
        if opt is not None and opt.metavar is None:
            opt.metavar = ""  # a flag too
        return opt


class _App(typer.Typer):
    def command(self, *args: Any, panels: dict[str, tuple[str, ...]] | None = None,
                **kwargs: Any) -> Callable[[F], F]:
        """`panels`: {help panel title: option (parameter) names}; the options not named stay in
        the first panel, "Options", so a long --help starts with what most runs need."""
        kwargs.setdefault("cls", type("_PanelledCommand", (_Command,), {"panels": panels or {}}))
        return super().command(*args, **kwargs)


app = _App(
    name="slurmresume",
    help="Preemptible PyTorch training on Slurm: submit, watch, and manage checkpoints.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"slurmresume {__version__}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                                help="Print the version and exit.")] = False) -> None:
    """Preemptible PyTorch training on Slurm: submit, watch, and manage checkpoints."""


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

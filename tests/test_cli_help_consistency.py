"""One `--help` for every command (issue 48, item 6): `help_problems` walks a Typer app and holds
each command to the same rules, and the checker is itself tested on a small app with planted
inconsistencies, so that a rule which silently stopped matching would fail here.

The rules:
- the checkpoint root is `-d/--ckpt-dir DIR` wherever a command takes one (an option whose help
  starts "Checkpoint root"); every command takes one except those in TAKES_NO_ROOT, with why;
- every option and argument shows its default once, as `[default: ...]` (never "(default: ...)"
  or "Default: ..." in its help); a plain flag (off unless given) shows none; a required one
  shows `[required]` instead;
- every command has `--json`, with the one help text (each prints a result a script may want to
  read: a verdict, a plan, a path, a report, a job id, the file it wrote);
- each positional is named by an upper-case METAVAR made of the words of POSITIONAL_WORDS
  joined by "|" (STEP|PATH|URL), never by the Python parameter's name.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.testing import CliRunner

from slurmresume.cli import app
from slurmresume.cli.options import CkptDir, JsonOut

ROOT_FLAGS = {"-d", "--ckpt-dir"}
TAKES_NO_ROOT = {
    # --workdir holds the drill's two roots (uninterrupted/ and preempted/) and is refused as a
    # root by the other commands ("a drill's folder is not a root"): -d would name the wrong thing
    "drill": "its --workdir is the parent of the two runs' roots",
}
POSITIONAL_WORDS = {"STEP", "PATH", "URL", "ROOT", "TRAIN_SCRIPT", "ARGS"}
JSON_HELP = "Print one JSON object on stdout instead of the text report."
ENV = {"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}


def _rows(text: str) -> list[str]:
    """Rendered rich help -> the text of each option's or argument's row(s), name first."""
    rows: list[str] = []
    inside = False
    for line in text.splitlines():
        if line.startswith("╭"):
            inside = True
            continue
        if line.startswith("╰"):
            inside = False
            continue
        if not inside:
            continue
        body = line.strip("│ ")
        lead = len(line) - len(line.lstrip("│ *"))
        if lead <= 8 and body:
            rows.append(body)
        elif rows:
            rows[-1] += " " + body
    return rows


def _row_of(rows: list[str], name: str) -> str | None:
    for row in rows:
        first = row.lstrip("* ").split()[0]
        if first == name:
            return re.sub(r"\s+", " ", row)
    return None


def _plain_flag(p: Any) -> bool:
    return bool(getattr(p, "is_flag", False)) and not getattr(p, "secondary_opts", None) and not p.default


def help_problems(the_app: typer.Typer, takes_no_root: dict[str, str]) -> list[str]:
    """Every departure from the rules above, one line each ("command: what")."""
    group = typer.main.get_command(the_app)
    bad: list[str] = []
    for name, cmd in sorted(group.commands.items()):  # type: ignore[attr-defined]
        r = CliRunner().invoke(the_app, [name, "--help"], env=ENV)
        if r.exit_code != 0:
            bad.append(f"{name}: --help exits {r.exit_code}")
            continue
        rows = _rows(r.stdout)
        params = [p for p in cmd.params if p.name != "help"]
        roots = [p for p in params if p.param_type_name == "option" and (p.help or "").startswith("Checkpoint root")]
        for p in roots:
            if set(p.opts) != ROOT_FLAGS or p.name != "ckpt_dir" or p.metavar != "DIR":
                bad.append(f"{name}: the root is {'/'.join(p.opts)} ({p.name}, {p.metavar}), not -d/--ckpt-dir DIR")
        if not roots and name not in takes_no_root:
            bad.append(f"{name}: takes no -d/--ckpt-dir (if right, say why in TAKES_NO_ROOT)")
        json_opts = [p for p in params if "--json" in getattr(p, "opts", ())]
        if not json_opts:
            bad.append(f"{name}: no --json")
        elif (json_opts[0].help or "") != JSON_HELP:
            bad.append(f"{name}: --json says {json_opts[0].help!r}, not the shared help")
        for p in params:
            label = max(p.opts, key=len) if p.param_type_name == "option" else (p.metavar or p.name or "")
            if p.param_type_name == "argument":
                words = (p.metavar or "").split("|")
                if p.metavar is None or not set(words) <= POSITIONAL_WORDS:
                    bad.append(f"{name}: positional {p.name!r} is named {p.metavar or p.name!r}, "
                               f"not with the words {sorted(POSITIONAL_WORDS)}")
            if getattr(p, "hidden", False):
                continue
            row = _row_of(rows, label)
            if row is None:
                bad.append(f"{name}: {label} not found in --help")
                continue
            shown = re.findall(r"default\s*:", row, re.IGNORECASE)
            styled = row.count("[default: ")
            if p.required or _plain_flag(p):
                if shown:
                    bad.append(f"{name}: {label} is {'required' if p.required else 'a flag'} but shows a default")
            elif len(shown) != 1 or styled != 1:
                bad.append(f"{name}: {label} shows its default {len(shown)} time(s), {styled} as [default: ...]: {row}")
            elif re.search(r"\[default: \(", row):
                bad.append(f"{name}: {label} shows [default: (...)]: give show_default a plain description")
    return bad


def test_every_command_follows_the_help_rules() -> None:
    assert help_problems(app, TAKES_NO_ROOT) == []


def test_every_submit_option_is_placed_in_a_typed_options_object() -> None:
    """`submit` used to forward `locals()` minus an exclusion list to the JobSpec: a new option
    went to it unnoticed. Now each option is a field of SpecOptions (to the JobSpec) or of
    SubmitFlags (steers the command), exactly one, and SpecOptions holds only JobSpec fields."""
    from slurmresume.cli.job_inputs import SpecOptions
    from slurmresume.job.config import JobSpec
    from slurmresume.job.submitflow import SubmitFlags

    cmd = typer.main.get_command(app).commands["submit"]  # type: ignore[attr-defined]
    options = {p.name for p in cmd.params if p.name not in ("help", "script", "script_args")}
    spec = {f.name for f in fields(SpecOptions)}
    flags = {f.name for f in fields(SubmitFlags)}
    assert not spec & flags
    assert options == spec | flags, (sorted(options - spec - flags), sorted((spec | flags) - options))
    assert spec <= set(JobSpec.__dataclass_fields__) | {"gres"}, sorted(spec - set(JobSpec.__dataclass_fields__))


def _planted() -> typer.Typer:
    """A tiny app: `good` follows every rule; each other command breaks one. Its commands are
    built as the real app builds them (its command class), except `described`'s."""
    ours = {"cls": type(typer.main.get_command(app).commands["status"])}  # type: ignore[attr-defined]
    bad_app = typer.Typer()

    @bad_app.callback()
    def _main() -> None:
        """(a group, so that each command is a subcommand)"""

    @bad_app.command(**ours)
    def good(step: Annotated[str, typer.Argument(metavar="STEP|URL", help="A step.")] = "latest",
             ckpt_dir: CkptDir = None, limit: Annotated[int, typer.Option(help="At most.")] = 3,
             fast: Annotated[bool, typer.Option("--fast", help="Quickly.")] = False, as_json: JsonOut = False) -> None:
        """Fine."""

    @bad_app.command(**ours)
    def rootless(as_json: JsonOut = False) -> None:
        """No root at all."""

    @bad_app.command(**ours)
    def other_root(root: Annotated[Path | None, typer.Option("--root", help="Checkpoint root: x.",
                                                                      show_default="$X")] = None,
                   as_json: JsonOut = False) -> None:
        """The root spelled differently."""

    @bad_app.command(**ours)
    def paren(ckpt_dir: CkptDir = None, as_json: JsonOut = False,
              nodes: Annotated[int | None, typer.Option(help="Nodes. (default: 1)")] = None) -> None:
        """A default written into the help text."""

    @bad_app.command()
    def described(as_json: JsonOut = False,
                  mem: Annotated[str | None, typer.Option(help="Memory.", show_default="the partition's")] = None) -> None:
        """A described default Typer prints as [default: (...)] (no _Command to print it plainly)."""

    @bad_app.command(**ours)
    def silent(ckpt_dir: CkptDir = None, as_json: JsonOut = False,
               port: Annotated[int | None, typer.Option(help="A port.")] = None) -> None:
        """No default shown at all."""

    @bad_app.command(**ours)
    def nojson(ckpt_dir: CkptDir = None) -> None:
        """No --json."""

    @bad_app.command(**ours)
    def lowercase(which: Annotated[str, typer.Argument(help="A step.")] = "latest", ckpt_dir: CkptDir = None,
                  as_json: JsonOut = False) -> None:
        """A positional named by its parameter."""

    return bad_app


def test_the_checker_finds_each_planted_inconsistency() -> None:
    found = help_problems(_planted(), {"described": "its one problem is planted elsewhere"})
    by_command = {line.split(":", 1)[0] for line in found}
    assert by_command == {"rootless", "other-root", "paren", "described", "silent", "nojson", "lowercase"}, found
    text = "\n".join(found)
    assert "rootless: takes no -d/--ckpt-dir" in text
    assert "other-root: the root is --root" in text
    assert "paren: --nodes shows its default" in text
    assert "described: --mem shows [default: (...)]" in text
    assert "silent: --port shows its default 0 time(s)" in text
    assert "nojson: no --json" in text
    assert "lowercase: positional 'which' is named 'which'" in text
    assert len(found) == 7, found

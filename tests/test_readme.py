"""Every `slurmresume ...` command the README shows parses (issue 46): its subcommand exists and
that subcommand's `--help` lists every option the command uses. Commands are read from the
README's code blocks (fenced, except python/toml, and indented) and from its inline code spans
that start with `slurmresume `; `python3 -m slurmresume` counts as `slurmresume`; whatever
follows a bare `--` is the script's. (Every command appearing in the README: test_cli_ckpt.)"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import dataclass

import typer
from helpers.procs import REPO
from typer.testing import CliRunner

from slurmresume.cli import app

SEPARATORS = {"&&", "||", "|", ";", "&"}
NOT_SHELL = {"python", "py", "toml", "json", "text"}  # fenced blocks whose lines are no commands


@dataclass(frozen=True)
class Command:
    line: int  # 1-based line of the README it came from
    sub: str  # the subcommand ("" when none)
    options: tuple[str, ...]  # every option used before `--`, without its `=value`


def shell_lines(text: str) -> list[tuple[int, str]]:
    """Pure: (line number, text) of each line that is shell: inside a fenced block that is not
    python/toml, an indented (4-space) block, or an inline code span starting `slurmresume `."""
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^\s*```(\w*)", line)
        if m:
            fence = None if fence is not None else m.group(1).lower()
            continue
        if fence is not None:
            if fence not in NOT_SHELL:
                out.append((n, line))
        elif line.startswith("    "):
            out.append((n, line))
        else:
            out += [(n, span) for span in re.findall(r"`(slurmresume [^`]*)`", line)]
    return out


def commands_in(text: str) -> list[Command]:
    """Pure: every slurmresume invocation in the README text. Brackets of a usage line
    (`[--tensors]`, `[-- args]`) are dropped; a line shlex cannot split is skipped."""
    found: list[Command] = []
    for n, line in shell_lines(text):
        lexer = shlex.shlex(line.replace("[", " ").replace("]", " "), posix=True, punctuation_chars="&|;")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        try:
            tokens = list(lexer)
        except ValueError:
            continue
        start = 0
        for i in range(len(tokens) + 1):
            if i == len(tokens) or tokens[i] in SEPARATORS:
                words = tokens[start:i]
                start = i + 1
                while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                    words = words[1:]  # VAR=value before the command
                if words[:1] == ["slurmresume"]:
                    args = words[1:]
                elif len(words) >= 3 and re.match(r"^python3?$", words[0]) and words[1:3] == ["-m", "slurmresume"]:
                    args = words[3:]
                else:
                    continue
                if "--" in args:
                    args = args[:args.index("--")]
                sub = args[0] if args and not args[0].startswith("-") else ""
                options = tuple(a.split("=", 1)[0] for a in args if re.match(r"^--?[A-Za-z]", a))
                found.append(Command(n, sub, options))
    return found


@functools.cache
def help_text(sub: str) -> str:
    r = CliRunner().invoke(app, [sub, "--help"], env={"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    return r.stdout


def problems(cmds: list[Command]) -> list[str]:
    """What does not parse: an unknown subcommand, or an option its --help does not list."""
    subs = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    bad = []
    for c in cmds:
        if c.sub not in subs:
            bad.append(f"README line {c.line}: `slurmresume {c.sub}` is not a command ({sorted(subs)})")
            continue
        listed = help_text(c.sub)
        bad += [f"README line {c.line}: `slurmresume {c.sub} {opt}`: {opt} is not in `{c.sub} --help`"
                for opt in c.options if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", listed)]
    return bad


def test_every_readme_command_parses() -> None:
    cmds = commands_in((REPO / "README.md").read_text())
    subs = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]
    assert subs <= {c.sub for c in cmds}, "the README should show every command in a code block or span"
    assert not problems(cmds), "\n".join(problems(cmds))


def test_a_readme_command_with_an_unknown_option_or_command_is_caught() -> None:
    """The check itself: a bad option, a bad subcommand, and both spellings of the program;
    the script's own options after `--` and other programs are not judged."""
    text = "\n".join([
        "Run it:",
        "",
        "    python3 -m pip install -e . && slurmresume status -d runs/x --no-such-option 3",
        "",
        "```bash",
        "python3 -m slurmresume prune --keep 3 --dry-run   # fine",
        "SLURMRESUME_CKPT_DIR=/x slurmresume stauts",
        "slurmresume drill train.py --preemptions 2 -- --not-ours 1",
        "torchrun --nproc-per-node 2 train.py --bogus",
        "```",
        "",
        "```python",
        "slurmresume = 1  # not shell",
        "```",
        "Inline: `slurmresume verify [STEP] [--all] [--bogus-flag]`.",
    ])
    cmds = commands_in(text)
    assert [(c.sub, c.options) for c in cmds] == [
        ("status", ("-d", "--no-such-option")), ("prune", ("--keep", "--dry-run")), ("stauts", ()),
        ("drill", ("--preemptions",)), ("verify", ("--all", "--bogus-flag"))]
    bad = problems(cmds)
    assert len(bad) == 3, bad
    assert "--no-such-option is not in `status --help`" in bad[0] and "line 3" in bad[0]
    assert "`slurmresume stauts` is not a command" in bad[1]
    assert "--bogus-flag is not in `verify --help`" in bad[2]

"""`--help` shows every option's default; every error message of the user-error table is
explained in docs/troubleshooting.md (every command in README.md: test_cli_ckpt)."""

from __future__ import annotations

import re

import pytest
import typer
from helpers.procs import REPO
from typer.testing import CliRunner

from slurmresume.cli import app

COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def option_blocks(text: str) -> dict[str, str]:
    """Rendered rich help -> {option name: the text of its row(s)}."""
    blocks: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"^[│|]\s+\*?\s*(--[a-z][a-z0-9-]*)", line)
        if m:
            current = m.group(1)
            blocks[current] = ""
        if current:
            blocks[current] += line + "\n"
        if line.startswith("╰"):
            current = None
    return blocks


@pytest.mark.parametrize("name", COMMANDS)
def test_help_shows_every_default(name: str) -> None:
    r = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    blocks = option_blocks(r.stdout)
    cmd = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    missing = []
    for p in cmd.params:
        if p.param_type_name != "option" or p.name == "help" or getattr(p, "is_flag", False) or p.required:
            continue  # a flag's default is "off"; a required option has none
        opt = max(p.opts, key=len)
        assert opt in blocks, (opt, r.stdout)
        if "default" not in blocks[opt].lower():
            missing.append(opt)
    assert not missing, f"{name}: options whose --help shows no default: {missing}"


def test_every_error_message_in_troubleshooting() -> None:
    from test_user_errors import ROWS

    doc = (REPO / "docs" / "troubleshooting.md").read_text()
    missing = [r.message for r in ROWS if r.message not in doc]
    assert not missing, f"messages not explained in docs/troubleshooting.md: {missing}"


def render_help(name: str, columns: int) -> str:
    r = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": str(columns), "NO_COLOR": "1", "TERM": "dumb"})
    assert r.exit_code == 0, r.output
    return r.stdout


@pytest.mark.parametrize("name", COMMANDS)
def test_help_shows_each_default_once_and_no_type_on_a_flag(name: str) -> None:
    """`drill --help` said "(default: 0)" and "[default: 0]" for one option; every flag (--json,
    --help, ...) carried a `<bool>` type though it takes no value (issue 31)."""
    text = render_help(name, 250)
    assert "<bool>" not in text
    twice = {opt: block for opt, block in option_blocks(text).items()
             if len(re.findall(r"[\[(]default[:=]", block.lower())) > 1}
    assert not twice, f"{name}: options showing their default twice: {sorted(twice)}"


@pytest.mark.parametrize("name", COMMANDS)
def test_help_text_is_reflowed_to_an_80_column_terminal(name: str) -> None:
    """The command's description at COLUMNS=80 wraps like a paragraph: no line ends early while
    its paragraph goes on (the docstrings' own breaks at ~90 columns broke raggedly at 80).
    A line starting "Example:" or "Exit codes:" still starts its own line."""
    lines = render_help(name, 80).split("╭")[0].splitlines()
    ragged = [(line, nxt) for line, nxt in zip(lines, lines[1:], strict=False)
              if nxt.strip() and line.strip() and not nxt.strip().startswith(("Example:", "Exit codes:"))
              and not line.lstrip().startswith("Usage:")
              and len(line.rstrip()) + 1 + len(nxt.split()[0]) <= 79]
    assert not ragged, f"{name}: lines broken before the terminal's edge: {ragged}"


def test_submit_help_shows_the_common_options_first() -> None:
    """`submit --help` had 37 options in one panel; the ones a first job needs come first, the
    rest follow in panels by topic (every one still shown with its default: see above)."""
    text = render_help("submit", 250)  # wide: no help line wraps onto a "--name" (option_blocks)
    panels = {chunk.split(" ─")[0]: option_blocks("╭─ " + chunk) for chunk in text.split("╭─ ")[1:]}
    titles = list(panels)
    assert titles[:2] == ["Arguments", "Options"], titles
    assert sorted(panels["Options"]) == sorted([
        "--ckpt-dir", "--nodes", "--gpus-per-node", "--nproc-per-node", "--time", "--partition", "--account",
        "--signal", "--local", "--dry-run", "--json", "--help"])
    assert len(titles) > 3 and sum(len(p) for p in panels.values()) == 39  # 39 with --snapshot-every (#49)

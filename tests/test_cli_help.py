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

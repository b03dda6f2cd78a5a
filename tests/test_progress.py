"""Long operations draw progress on a terminal (stderr) and stay quiet in pipes."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.core import tiny_state
from helpers.procs import REPO, clean_env

from slurmresume import Checkpointer


def _root(tmp: Path) -> Path:
    ckpt = Checkpointer(tmp / "r", handle_signals=False)
    for s in (1, 2, 3):
        ckpt.save(s, tiny_state(s))
    ckpt.close()
    return tmp / "r"


def _run(args: list[str], tty: bool) -> tuple[int, str]:
    """Exit code and stderr of the CLI, with stderr on a pseudo-terminal or a pipe."""
    env = clean_env(PYTHONPATH=str(REPO), COLUMNS="100", TERM="xterm")
    cmd = [sys.executable, "-m", "slurmresume", *args]
    if not tty:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        return p.returncode, p.stderr
    master, slave = pty.openpty()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return p.wait(timeout=120), b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
@pytest.mark.parametrize("args,label", [(["verify", "--all"], "verifying checkpoints"),
                                        (["inspect", "latest", "--tensors"], "reading tensors")])
def test_progress_on_a_terminal_only(tmp_path, args, label):
    root = _root(tmp_path)
    code, err = _run([*args, "-d", str(root)], tty=True)
    assert code == 0 and label in err, err
    code, err = _run([*args, "-d", str(root)], tty=False)
    assert code == 0 and err == "", err


def test_inspect_tensors_keeps_names_whole_at_80_columns(tmp_path):
    from typer.testing import CliRunner

    from slurmresume.cli import app

    root = _root(tmp_path)
    r = CliRunner().invoke(app, ["inspect", "latest", "--tensors", "-d", str(root)],
                           env={"COLUMNS": "80", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""})
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80
    for name in ("model/0.weight", "model/2.bias", "model/2.weight"):
        i = lines.index(name)
        assert lines[i + 1].startswith("    F32 ") and "min " in lines[i + 1]

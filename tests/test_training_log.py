"""The training log has one line per event a user cares about: restored (step, path, seconds),
warning received, saved (step, seconds, bytes) — with no logging set up by the script."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from helpers.procs import REPO, clean_env

SCRIPT = """
import os, signal, sys, torch
sys.path.insert(0, {tests!r})
import slurmresume
from helpers.core import tiny_state, warn_self
ckpt = slurmresume.Checkpointer({root!r}, save_every=2)
state = tiny_state(0)
step = ckpt.restore(state)
while step < 6:
    step += 1
    if step == 5 and os.environ.get("WARN"):
        warn_self(ckpt)
    ckpt.step(step, state)
ckpt.close()
"""


@pytest.mark.slow
def test_log_lines_without_logging_setup(tmp_path):
    script = tmp_path / "t.py"
    script.write_text(SCRIPT.format(tests=str(REPO / "tests"), root=str(tmp_path / "root")))
    env = clean_env(PYTHONPATH=str(REPO))
    first = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    saved = re.findall(r"slurmresume: saved step (\d+) in [\d.]+ s \(([\d.]+ [KMG]?B), periodic\)", first.stderr)
    assert [s for s, _ in saved] == ["2", "4", "6"], first.stderr
    (tmp_path / "root" / "step_000000006").rename(tmp_path / "root" / "gone")
    second = subprocess.run([sys.executable, str(script)], env={**env, "WARN": "1"}, capture_output=True,
                            text=True, timeout=120)
    assert re.search(r"slurmresume: restored from step 4 \(.*step_000000004\) in [\d.]+ s", second.stderr), \
        second.stderr
    assert "slurmresume: warning signal received (preempt): saving step 5, then exiting" in second.stderr
    assert re.search(r"saved step 5 in [\d.]+ s \(.*, preempt\)", second.stderr)
    assert second.returncode == 75

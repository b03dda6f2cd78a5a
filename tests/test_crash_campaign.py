"""The crash campaign (issue #27): `submit --local` SIGKILLed (its whole process tree, as the OOM
killer or a node reboot would) at random moments, and each time the same command run again,
no --takeover: every run that reaches its restore resumes the newest complete checkpoint,
`verify --all` passes after each kill, and the last run completes. 6 kills in the default lane
(two during start-up or restore, four after a commit: training or a save in flight), the issue's
12 with `bash scripts/test --exhaustive`; the file-system boundaries of a save are each killed at
in test_campaigns.py::test_crash_campaign."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import clean_env, signal_tree

from slurmresume.checkpoint.store import find_latest
from slurmresume.contract import ENV_LEASE_HEARTBEAT

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"
STEPS = 200  # more than 12 runs of 1-3 saves of 4 steps reach: only the last run completes


def _events(root: Path) -> list[dict]:
    try:
        lines = (root / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:  # a line torn by the kill
            pass
    return out


def _alive(pids: list[int]) -> list[int]:
    left = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    left.append(pid)
        except (OSError, IndexError):
            pass
    return left


def _wait_for_moment(proc: subprocess.Popen, root: Path, seen: int, rng: random.Random, *, early: bool) -> None:
    """A random moment of this run: during start-up or restore (`early`: 0.5-6 s after the
    start), else 0-1.5 s after its first or second new commit (training, or a save in flight).
    Start-up takes 5-20 s on a loaded machine, so a moment by the clock alone would miss training."""
    if early:
        deadline = time.monotonic() + rng.uniform(0.5, 6.0)
    else:
        commits = rng.choice((1, 2))
        end = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < end and sum(
                e.get("event") == "save_committed" for e in _events(root)[seen:]) < commits:
            time.sleep(0.05)
        deadline = time.monotonic() + rng.uniform(0.0, 1.5)
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("kills", [6, pytest.param(12, marks=pytest.mark.exhaustive)])
def test_sigkill_at_random_moments_and_the_same_command_resumes(tmp_path: Path, kills: int) -> None:
    root = tmp_path / "root"
    command = [sys.executable, "-m", "slurmresume", "submit", str(EXAMPLE), "--ckpt-dir", str(root), "--local",
               "--", "--steps", str(STEPS), "--save-every", "4", "--step-sleep", "0.1"]
    env = clean_env(**{ENV_LEASE_HEARTBEAT: "0.5"})  # a killed run's lease ages out in 1.5 s, not 90 s
    rng = random.Random(27)
    resumed: list[tuple[int, int]] = []
    for kill in range(kills + 1):
        newest = find_latest(root, warn=False) if root.exists() else None
        seen = len(_events(root))
        errlog = tmp_path / f"run-{kill}.err"
        with errlog.open("w") as err_file:
            proc = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=err_file,
                                    start_new_session=True)
        if kill < kills:
            _wait_for_moment(proc, root, seen, rng, early=kill % 3 == 0)
            assert proc.poll() is None, f"run {kill} ended before its kill: {errlog.read_text()[-3000:]}"
            pids = signal_tree(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            end = time.monotonic() + 30
            while _alive(pids) and time.monotonic() < end:
                time.sleep(0.1)
            assert not _alive(pids), "a process of the killed tree survived"
            check = subprocess.run([sys.executable, "-m", "slurmresume", "verify", "--all", "--ckpt-dir", str(root)],
                                   env=env, capture_output=True, text=True, timeout=300)
            assert check.returncode == 0 or not list(root.glob("step_*")), check.stdout + check.stderr
        else:
            assert proc.wait(timeout=600) == 0, errlog.read_text()[-4000:]
        restored = [e for e in _events(root)[seen:] if e.get("event") == "restored"]
        if newest is not None and restored:
            resumed.append((newest.step, restored[0]["step"]))
            assert restored[0]["step"] == newest.step, (kill, restored, newest.step)
    assert find_latest(root, warn=False).step == STEPS
    assert len(resumed) >= kills // 2, resumed  # the campaign did resume, run after run

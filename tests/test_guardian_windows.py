"""Issue #26, the guardian's coverage windows (job/guardian.py), each with the real launcher
function (`run_torchrun`) and a real guardian process; the launcher is SIGKILLed, as a node's
OOM killer or an impatient user does:

- the launcher dies between starting torchrun (`Popen`) and telling the guardian its pid
  (`track()`): the agent must still die with it;
- a process of the tree double-forks (its child forks and exits at once, faster than one of the
  guardian's walks, 0.25 s): the grandchild must die with the tree too.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import clean_env

LAUNCHER = """
import os, signal, sys
from pathlib import Path
from slurmresume.job import torchrun
from slurmresume.job.guardian import Guardian

guardian = Guardian()
if sys.argv[2] == "die-before-track":  # the SIGKILL lands right after Popen returned, before track()
    guardian.track = lambda pid: os.kill(os.getpid(), signal.SIGKILL)
torchrun.run_torchrun(["sh", "-c", sys.argv[1]], dict(os.environ), Path(sys.argv[3]), "r", signal.SIGUSR1,
                      torchrun.Relay(signal.SIGUSR1), guardian=guardian)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _wait_file(path: Path, proc: subprocess.Popen, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            text = path.read_text().strip()
            if text.isdigit():
                return int(text)
        except OSError:
            pass
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise AssertionError(f"{path} never written: {(path.parent / 'launcher.log').read_text()[-2000:]}")


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("case", ["die-before-track", "double-fork"])
def test_nothing_of_the_tree_outlives_a_sigkilled_launcher(tmp_path: Path, case: str) -> None:
    """die-before-track: the agent (here `sh`) writes its pid, the launcher is SIGKILLed before
    track(): the agent is gone within 5 s (the old guardian never learned its pid: it lived on).
    double-fork: the agent's child forks a `sleep` and exits at once, then the launcher is
    SIGKILLed: agent and grandchild are gone within 5 s (the old guardian never saw the
    grandchild, re-parented to init before its next walk)."""
    agent_pid, orphan_pid = tmp_path / "agent.pid", tmp_path / "orphan.pid"
    if case == "double-fork":
        script = f"(sleep 300 & echo $! > {orphan_pid}.tmp; mv {orphan_pid}.tmp {orphan_pid}); " \
                 f"echo $$ > {agent_pid}; exec sleep 300"
    else:
        script = f"echo $$ > {agent_pid}; exec sleep 300"
    log = open(tmp_path / "launcher.log", "w")  # noqa: SIM115 - a file: the tree's copies of a pipe would hold it open
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, script, case, str(tmp_path)],
                            env=clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", "")),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    pids = [_wait_file(agent_pid, proc)]
    if case == "double-fork":
        pids.append(_wait_file(orphan_pid, proc))
        time.sleep(1.0)  # the guardian walked several times since
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        left = _gone_within(pids, 5.0)
    finally:
        _kill(pids)
    assert left == [], f"{case}: still alive after the launcher's SIGKILL: {left}"

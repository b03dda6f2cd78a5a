"""Heartbeat directories of SIGKILLed launchers are removed by the next launcher on the node, and
nothing else is: a live launcher's directory, an untagged (older) one, another namespace's."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurmresume.job import hangwatch
from slurmresume.job.hbsweep import PREFIX, namespace_and_boot, owner_tag, stale, start_ticks, sweep

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs Linux /proc")

LAUNCHER = """
import sys
from slurmresume.job.hangwatch import heartbeat_dir
d = heartbeat_dir(sys.argv[1], 2)
(d / "rank-0.hb").write_bytes(b"x" * 64)
print(d, flush=True)
sys.stdin.read()
"""


def _launcher(run_id: str, tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    """A real process that makes its heartbeat directory the launcher's way and holds it."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHER, run_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=env)
    line = proc.stdout.readline().strip() if proc.stdout else ""
    assert line, "the launcher made no heartbeat directory"
    return proc, Path(line)


def test_a_sigkilled_launchers_directory_is_removed_by_the_next_one(tmp_path: Path) -> None:
    dead, dead_dir = _launcher("sweepdead", tmp_path)
    live, live_dir = _launcher("sweeplive", tmp_path)
    try:
        os.kill(dead.pid, signal.SIGKILL)  # HangWatch.close never runs: the directory stays
        dead.wait(timeout=30)
        assert dead_dir.is_dir() and (dead_dir / "rank-0.hb").exists()
        untagged = dead_dir.parent / f"{PREFIX}olderversion-12345-abcdefgh"
        untagged.mkdir()
        mine = hangwatch.heartbeat_dir("sweepnext", 2)
        assert mine is not None and mine.is_dir()
        assert not dead_dir.exists(), "the dead launcher's directory was left"
        assert live_dir.is_dir() and (live_dir / "rank-0.hb").exists(), "a live launcher's directory was removed"
        assert untagged.is_dir(), "an untagged directory (nothing says whose) was removed"
        assert live.poll() is None
    finally:
        live.kill()
        live.wait(timeout=30)
        for d in (dead_dir, live_dir, dead_dir.parent / f"{PREFIX}olderversion-12345-abcdefgh"):
            shutil.rmtree(d, ignore_errors=True)
        if "mine" in locals() and mine is not None:
            shutil.rmtree(mine, ignore_errors=True)


def test_the_name_carries_this_process_as_owner(tmp_path: Path) -> None:
    d = hangwatch.heartbeat_dir("tagged", 1)
    try:
        assert d is not None and f"-{owner_tag()}-" in d.name
        assert not stale(d.name, namespace_and_boot(), start_ticks)
    finally:
        if d is not None:
            shutil.rmtree(d, ignore_errors=True)


def test_stale_is_only_a_provably_gone_owner() -> None:
    ns = (4026531836, "0123456789ab")
    tag = f"o4242.1000.{ns[0]}.{ns[1]}"
    name = f"{PREFIX}job-7.0.0-{tag}-k2j_x9a1"
    assert stale(name, ns, lambda pid: None)  # no such process
    assert stale(name, ns, lambda pid: 999)  # the pid was reused by a later process
    assert not stale(name, ns, lambda pid: 1000)  # its owner is alive
    assert not stale(name, (ns[0] + 1, ns[1]), lambda pid: None)  # made in another pid namespace
    assert not stale(name, (ns[0], "0123456789ac"), lambda pid: None)  # on another host (or boot)
    assert not stale(name, None, lambda pid: None)  # this namespace unknown
    assert not stale(f"{PREFIX}job-7.0.0-k2j_x9a1", ns, lambda pid: None)  # untagged (an older version)
    assert not stale(f"other-job-{tag}-k2j_x9a1", ns, lambda pid: None)  # not ours
    assert not stale(f"{PREFIX}job-{tag}-k2j-x9a1", ns, lambda pid: None)  # the tag is not last


def test_sweep_leaves_links_and_other_users_alone(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    start = start_ticks(gone.pid)
    gone.wait(timeout=30)
    time.sleep(0.05)
    ns, boot = namespace_and_boot()
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / f"{PREFIX}l-o{gone.pid}.{start}.{ns}.{boot}-aaaa"
    link.symlink_to(target)
    plain = tmp_path / f"{PREFIX}d-o{gone.pid}.{start}.{ns}.{boot}-bbbb"
    plain.mkdir()
    removed = sweep(tmp_path)
    assert removed == [plain.name] and not plain.exists()
    assert link.is_symlink() and (target / "keep").exists()

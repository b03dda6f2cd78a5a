"""One owner per checkpoint root (issue #12): a lease file with a heartbeat; a second writer on a
root that a live run owns is refused before anything is written, naming the owner and
--takeover; a takeover only once the owner is provably gone. Real processes, a fake `squeue` on
PATH only to say what Slurm would."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.procs import clean_env, signal_tree
from typer.testing import CliRunner

from slurmresume import ownership
from slurmresume.checkpoint.layout import OWNER
from slurmresume.cli import app
from slurmresume.contract import ENV_OWNER

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"


def _fake_squeue(tmp: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    bindir = tmp / "fakebin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "squeue"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")


def _lease(**kw) -> ownership.Lease:
    now = time.time()
    base = ownership.Lease("slurm-77", "slurm", "77", 1, "othernode", now - 3600, now)
    return replace(base, **kw)


@pytest.mark.parametrize(("squeue", "gone"), [
    ("echo RUNNING", False), ("echo PENDING", False), ("echo COMPLETING", False),
    ("true", True),  # no longer listed
    ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", True),
    ("echo CANCELLED", True),
])
def test_a_slurm_owner_is_gone_only_when_squeue_says_so(tmp_path, monkeypatch, squeue: str, gone: bool) -> None:
    _fake_squeue(tmp_path, monkeypatch, squeue)
    assert ownership.judge(_lease())[0] is gone
    assert ownership.judge(_lease(heartbeat=0.0))[0] is gone  # squeue answers: the heartbeat does not matter


def test_without_an_answer_from_squeue_the_heartbeat_decides(tmp_path, monkeypatch) -> None:
    _fake_squeue(tmp_path, monkeypatch, "echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1")
    assert ownership.judge(_lease())[0] is False
    old = time.time() - ownership.STALE_AFTER_S - 1
    assert ownership.judge(_lease(heartbeat=old))[0] is True


def test_a_local_owner_is_gone_when_its_pid_is_dead_or_reused() -> None:
    assert ownership.judge(ownership.new_lease("local-x"))[0] is True  # this very process: not a second writer
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = ownership.new_lease("local-y", pid=alive.pid)
        assert ownership.judge(other)[0] is False
        assert ownership.judge(replace(other, pid_start="1"))[0] is True  # the pid now names another process
    finally:
        alive.kill()
        alive.wait()
    assert ownership.judge(other)[0] is True  # dead
    far = replace(other, host="elsewhere")  # another host: only the heartbeat can tell
    assert ownership.judge(far)[0] is False
    assert ownership.judge(replace(far, heartbeat=time.time() - 601))[0] is True


def test_the_same_owner_renews_and_keeps_since(tmp_path) -> None:
    first = ownership.acquire(tmp_path, "slurm-5")
    time.sleep(0.01)
    again = ownership.acquire(tmp_path, "slurm-5")  # a requeued run of the same job
    assert again.since == first.since and again.heartbeat >= first.heartbeat
    raw = json.loads((tmp_path / OWNER).read_text())
    assert raw["owner"] == "slurm-5" and raw["host"] == socket.gethostname()
    ownership.release(tmp_path, "slurm-other")  # not ours: stays
    assert (tmp_path / OWNER).exists()
    ownership.release(tmp_path, "slurm-5")
    assert not (tmp_path / OWNER).exists()


HOLDER = """
import sys, time
from slurmresume import Checkpointer
import torch
ck = Checkpointer(sys.argv[1], handle_signals=False)
ck.save(1, {"w": torch.ones(3)}) if len(sys.argv) > 2 else None
print("ready", flush=True)
time.sleep(600)
"""


def _snapshot(root: Path) -> dict[str, tuple[int, float]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != OWNER}


def invoke(*args: str):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


@pytest.mark.slow
def test_a_second_writer_is_refused_while_the_owner_lives_then_takes_over(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()  # a bare Checkpointer leases an existing root (restoring never creates one)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], env=clean_env(), stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = _snapshot(root)
        lease = json.loads((root / OWNER).read_text())
        assert lease["pid"] == holder.pid and lease["kind"] == "local"

        # `submit --local`: one line naming the owner and --takeover; nothing written or started
        res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(root), "--local", "--", "--steps", "2")
        assert res.exit_code == 1, res.output
        line = res.output.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line
        assert f"local run pid {holder.pid} on host {socket.gethostname()}" in line and "since" in line
        assert "--takeover" in line
        # a live owner is never taken over, not even with --takeover
        res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(root), "--local", "--takeover", "--", "--steps", "2")
        assert res.exit_code == 1 and "refusing to start a second writer" in res.output
        # a bare Checkpointer in another process is refused as well, before it writes anything
        bare = subprocess.run([sys.executable, "-c", "import sys; from slurmresume import Checkpointer; "
                               "Checkpointer(sys.argv[1], handle_signals=False)", str(root)],
                              env=clean_env(), capture_output=True, text=True, timeout=120)
        assert bare.returncode != 0 and "RootOwnedError" in bare.stderr and str(holder.pid) in bare.stderr
        # a rank under another launcher's run is refused too
        env = clean_env(**{ENV_OWNER: "slurm-999999"})
        rank = subprocess.run([sys.executable, "-c", "import sys; from slurmresume import Checkpointer; "
                               "Checkpointer(sys.argv[1], handle_signals=False)", str(root)],
                              env=env, capture_output=True, text=True, timeout=120)
        assert rank.returncode != 0 and "not by this run (slurm-999999)" in rank.stderr
        assert _snapshot(root) == before
        assert not (root / "logs").exists()  # _snapshot: events.jsonl and the step unchanged
    finally:
        signal_tree(holder.pid, signal.SIGKILL)
        holder.wait()

    # the owner died without releasing: provably gone (pid dead on this host), yet only --takeover takes it
    res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(root), "--local", "--", "--steps", "2")
    assert res.exit_code == 1 and "pass --takeover" in res.output and "no longer running" in res.output
    out = subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(EXAMPLE), "--ckpt-dir", str(root),
                          "--local", "--takeover", "--", "--steps", "3", "--save-every", "100"],
                         env=clean_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert (root / "step_000000003" / "COMMITTED").exists()
    assert not (root / OWNER).exists()  # a finished run frees the root

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

from slurmresume import evidence, ownership
from slurmresume.checkpoint.layout import OWNER
from slurmresume.cli import app
from slurmresume.contract import ENV_LEASE_HEARTBEAT, ENV_OWNER

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"


def _fake_slurm(tmp: Path, monkeypatch: pytest.MonkeyPatch, scontrol: str, sacct: str = "true") -> None:
    bindir = tmp / "fakebin"
    bindir.mkdir(exist_ok=True)
    for name, body in (("scontrol", f'[ "$2" = config ] && echo "ClusterName = c1" && exit 0; {scontrol}'),
                       ("sacct", sacct)):
        script = bindir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
    evidence.cluster_name.cache_clear()


def _lease(**kw) -> ownership.Lease:
    now = time.time()
    base = ownership.Lease("slurm-77", "slurm", "77", 1, "othernode", now - 3600, now - 100, cluster="c1")
    return replace(base, **kw)


INVALID = "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"


@pytest.mark.parametrize(("scontrol", "sacct", "state"), [
    ("echo 'JobId=77 JobState=RUNNING Reason=None'", "true", "alive"),
    ("echo 'JobId=77 JobState=PENDING Reason=Priority'", "true", "alive"),
    ("echo 'JobId=77 JobState=COMPLETING Reason=None'", "true", "alive"),
    ("echo 'JobId=77 JobState=CANCELLED Reason=None'", "true", "proven"),
    (INVALID, "echo COMPLETED", "proven"),  # purged from slurmctld: the accounting database remembers
    (INVALID, "printf 'CANCELLED by 0\\nRUNNING\\n'", "alive"),  # an id reused: one of them runs
    (INVALID, "true", "alive"),  # "Invalid job id" alone is no proof
    ("echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1", "exit 1", "alive"),
])
def test_a_slurm_owner_is_gone_only_when_its_cluster_says_it_ended(tmp_path, monkeypatch, scontrol: str, sacct: str,
                                                                    state: str) -> None:
    _fake_slurm(tmp_path, monkeypatch, scontrol, sacct)
    assert ownership.judge(_lease()).state == state
    assert ownership.judge(_lease(cluster="c2")).state == "alive"  # another cluster's job 77


def test_without_an_answer_only_a_stale_heartbeat_counts_and_only_as_weak_evidence(tmp_path, monkeypatch) -> None:
    _fake_slurm(tmp_path, monkeypatch, "echo 'slurm_load_jobs error: Socket timed out' >&2; exit 1", "exit 1")
    assert ownership.judge(_lease()).state == "alive"
    old = time.time() - ownership.STALE_AFTER_S - 1
    assert ownership.judge(_lease(heartbeat=old)).state == "stale"


def test_a_local_owner_is_gone_when_its_pid_is_dead_or_reused() -> None:
    assert ownership.judge(ownership.new_lease("local-x")).state == "proven"  # this very process: not a second writer
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        other = replace(ownership.new_lease("local-y", pid=alive.pid), heartbeat=time.time() - 100)
        assert ownership.judge(other).state == "alive"
        assert ownership.judge(replace(other, pid_start="1")).state == "proven"  # the pid now names another process
    finally:
        alive.kill()
        alive.wait()
    assert ownership.judge(other).state == "proven"  # dead
    assert ownership.judge(replace(other, heartbeat=time.time())).state == "fresh"  # proven, but wait it out
    far = replace(other, host="elsewhere")  # another host: only the heartbeat can tell, weakly
    assert ownership.judge(far).state == "alive"
    assert ownership.judge(replace(far, heartbeat=time.time() - 601)).state == "stale"


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
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True,
                              env=clean_env(**{ENV_LEASE_HEARTBEAT: "1"}))  # a fresh lease ages out in 3 s
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = _snapshot(root)
        lease = json.loads((root / OWNER).read_text())
        assert lease["pid"] == holder.pid and lease["kind"] == "local"

        # `submit --local`: one line naming the live owner; nothing written or started
        res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(root), "--local", "--", "--steps", "2")
        assert res.exit_code == 1, res.output
        line = res.output.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line
        assert f"local run pid {holder.pid} on host {socket.gethostname()}" in line and "since" in line
        assert "pid " in line and "is running" in line
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

    # the owner died without releasing: provably gone (pid dead on this host, its heartbeat aged
    # out): the same command takes the root over, no flag, in one line naming the previous owner
    out = subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(EXAMPLE), "--ckpt-dir", str(root),
                          "--local", "--", "--steps", "3", "--save-every", "100"],
                         env=clean_env(), capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert f"took over {root} from local run pid {holder.pid}" in out.stderr
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert (root / "step_000000003" / "COMMITTED").exists()
    assert not (root / OWNER).exists()  # a finished run frees the root

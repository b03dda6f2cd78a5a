"""What stands between a requeued job's launcher and its first step, and between a commit and the
requeue: the launcher does not wait for slurmctld before starting torchrun, a one-node job asks
no `scontrol` for its rendezvous address, and a one-node torchrun agent exits without the
interpreter's teardown once its workers are done (failures keep the ordinary path and status).
No timings are asserted here: scripts/bench_requeue.py measures them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.procs import free_port

from slurmresume.job.config import JobSpec
from slurmresume.job.node import rdzv_host, torchrun_command
from slurmresume.job.torchrun import JobClock

REPO = Path(__file__).resolve().parents[1]


def blocking_scontrol(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A `scontrol` that records each call, then blocks until `go` exists. Returns (bin, log, go)."""
    bindir, log, go = tmp_path / "bin", tmp_path / "scontrol.log", tmp_path / "go"
    bindir.mkdir()
    script = bindir / "scontrol"
    script.write_text(
        "#!/bin/sh\n"
        f"echo \"$@\" >> {log}\n"
        f"while [ ! -e {go} ]; do sleep 0.02; done\n"
        "case \"$2\" in config) echo 'KillWait                = 7 sec' ;; *) echo 'JobId=5 JobState=RUNNING' ;; esac\n")
    script.chmod(0o755)
    return bindir, log, go


def test_job_clock_does_not_hold_up_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir, log, go = blocking_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    got: list[JobClock] = []
    reader = threading.Thread(target=lambda: got.append(JobClock.read("5")), daemon=True)
    reader.start()
    reader.join(timeout=30)
    returned = bool(got)
    go.touch()  # unblock the fake scontrol in every case
    assert returned, "JobClock.read waited for slurmctld: torchrun would start only after its answers"
    assert got[0].kill_wait == 7.0  # the first use waits for the answer
    assert "show config" in log.read_text()


def test_one_node_rendezvous_needs_no_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bindir, log, go = blocking_scontrol(tmp_path)
    go.touch()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "n1")
    assert rdzv_host(1) == "127.0.0.1"
    assert not log.exists()
    rdzv_host(2)  # several nodes: the first node's NodeAddr, from scontrol
    assert "show node" in log.read_text()


def test_one_node_runs_torchrun_through_the_fast_exit_agent(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("")
    spec = JobSpec(script=tmp_path / "train.py", ckpt_dir=tmp_path / "ck")
    one = torchrun_command(spec, nnodes=1, endpoint="127.0.0.1:1", rdzv_id="1")
    two = torchrun_command(spec, nnodes=2, endpoint="h:1", rdzv_id="1")
    assert one[1:3] == ["-m", "slurmresume.job.agent"]
    assert two[1:3] == ["-m", "torch.distributed.run"]  # the first node's store serves the others' shutdown
    assert one[3:5] == ["--nnodes=1", "--nproc-per-node=1"]  # torchrun's own arguments, unchanged


@pytest.mark.parametrize("code", [0, 3])
def test_agent_skips_teardown_only_after_success(tmp_path: Path, code: int) -> None:
    """An atexit handler in the agent process stands for the interpreter's teardown: skipped when
    every worker succeeded, run (with torchrun's exit status 1) when one failed."""
    script, marker = tmp_path / "w.py", tmp_path / "teardown-ran"
    script.write_text(f"import sys\nsys.exit({code})\n")
    boot = ("import atexit, runpy, sys\n"
            f"atexit.register(lambda: open({str(marker)!r}, 'w').close())\n"
            "sys.argv = ['agent', *sys.argv[1:]]\n"
            "runpy.run_module('slurmresume.job.agent', run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", boot, "--standalone", "--nnodes=1", "--nproc-per-node=1",
                          "--max-restarts=0", str(script)], env=env, capture_output=True, text=True, timeout=300)
    if code == 0:
        assert res.returncode == 0, res.stderr[-2000:]
        assert not marker.exists()
    else:
        assert res.returncode == 1, res.stderr[-2000:]  # torchrun's own status for a failed worker group
        assert marker.exists()
        assert "ChildFailedError" not in res.stderr  # torchrun's report is one line of ours
        assert res.stderr.strip().splitlines()[-1] == "torchrun: rank 0 failed (exit code 3); its own output is above"


def test_process_start_time_is_on_the_wall_clock_to_the_tick() -> None:
    """The start-up breakdown (`started.launcher_started_at`, `restored.process_started_at`) and the
    `resumed` seconds shown by `status` compare a process's start with time.time(). /proc's
    `btime` is whole seconds, so btime + ticks was early by the boot's fraction of a second
    (0.52 s on the machine where this was found): a random offset of up to 1 s per boot that
    moved time from Slurm's phase into the launcher's."""
    from slurmresume.events import process_started_at

    for _ in range(3):
        before = time.time()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
        after = time.time()
        try:
            started = process_started_at(child.pid)
        finally:
            child.kill()
            child.wait()
        assert started is not None
        tick = 1 / os.sysconf("SC_CLK_TCK")  # the kernel's start time is in clock ticks
        assert before - tick - 0.005 <= started <= after + 0.005, (started - before, after - before)


def test_one_node_rendezvous_takes_no_random_delay(tmp_path: Path) -> None:
    """torchrun's c10d rendezvous sleeps a random 0-0.3 s before its first round (to spread the
    nodes' joins on a shared store); a one-node job has nobody to spread, and that sleep sat
    between the launcher's start and the ranks' start of every requeue. The one-node command
    runs the agent with its real arguments and records any such sleep; the ranks must still
    rendezvous (a gloo all-reduce over 2 ranks)."""
    script, delays, done = tmp_path / "w.py", tmp_path / "delays", tmp_path / "done"
    script.write_text("import os, torch, torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "t = torch.ones(1)\n"
                      "dist.all_reduce(t)\n"
                      f"open({str(done)!r} + os.environ['RANK'], 'w').write(str(int(t.item())))\n"
                      "dist.destroy_process_group()\n")  # else gloo's threads may abort the exit
    spec = JobSpec(script=script, ckpt_dir=tmp_path / "ck", nproc_per_node=2)
    cmd = torchrun_command(spec, nnodes=1, endpoint=f"127.0.0.1:{free_port()}", rdzv_id="7")
    boot = ("import runpy, sys\n"
            "import torch.distributed.elastic.rendezvous.utils as u\n"
            "import torch.distributed.elastic.rendezvous.dynamic_rendezvous as d\n"
            "def record(seconds):\n"
            f"    open({str(delays)!r}, 'a').write(repr(seconds) + '\\n')\n"
            "u._delay = d._delay = record\n"
            "sys.argv = ['agent', *sys.argv[1:]]\n"
            f"runpy.run_module({cmd[2]!r}, run_name='__main__')\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    res = subprocess.run([sys.executable, "-c", boot, *cmd[3:]], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert [(tmp_path / f"done{r}").read_text() for r in (0, 1)] == ["2", "2"]
    assert not delays.exists(), f"the rendezvous slept: {delays.read_text()}"


AGENT = """\
import os, subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
def got(signum, frame):
    open(sys.argv[1] + "/signalled", "w").write(repr(time.time()))
    sys.exit(0)
signal.signal(signal.SIGUSR1, got)
open(sys.argv[1] + "/ready", "w").close()
time.sleep(60)
''', sys.argv[1]])
worker.wait()
open(sys.argv[1] + "/agent-exit", "w").write(repr(time.time()))
"""


def test_launcher_relays_and_sees_the_exit_without_waiting_for_its_poll(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The warning reaches the ranks, and the agent's exit reaches the launcher's decision (the
    requeue), when they happen, not at the relay loop's next turn. The loop's period is made 5 s
    here so that a wait for it shows; the real one is 0.1 s, i.e. 0-0.1 s on each of two steps
    of every preemption. A stand-in agent (one child that records the warning and exits) and
    the real relay in this process, signalled as Slurm signals the launcher."""
    import signal

    from slurmresume.job import torchrun

    monkeypatch.setattr(torchrun, "POLL_S", 5.0)
    (tmp_path / "root").mkdir()
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    relay = torchrun.Relay(signal.SIGUSR1)
    relay.install()
    sent: list[float] = []

    def warn_when_ready() -> None:
        end = time.monotonic() + 60
        while not (tmp_path / "ready").exists() and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.2)  # the launcher is inside its wait by now
        sent.append(time.time())
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=warn_when_ready, daemon=True).start()
    try:
        result = torchrun.run_torchrun([sys.executable, str(agent), str(tmp_path)], dict(os.environ),
                                       tmp_path / "root", "r1", signal.SIGUSR1, relay)
        returned = time.time()
    finally:
        relay.uninstall()
    assert result.returncode == 0 and result.warned
    signalled = float((tmp_path / "signalled").read_text())
    exited = float((tmp_path / "agent-exit").read_text())
    assert signalled - sent[0] < 2.0, f"the warning reached the worker {signalled - sent[0]:.2f} s after it came"
    assert returned - exited < 2.0, f"the launcher saw the agent's exit {returned - exited:.2f} s late"

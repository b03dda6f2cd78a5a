"""Two emulated nodes of one Slurm job on this host: the real NodeLauncher twice (SLURM_NODEID 0
and 1, SLURM_NNODES=2, a fake `scontrol` for the job clock only), c10d rendezvous across them,
the rendezvous order the reverse of the Slurm order (helpers.procs.reversed_rendezvous_env: the
node with SLURM_NODEID=1 gets ranks 0..procs-1)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from helpers.procs import clean_env, process_tree, reversed_rendezvous_env, signal_tree

FAKE_SCONTROL = """#!/bin/sh
[ -n "$SCONTROL_LOG" ] && echo "$@" >> "$SCONTROL_LOG"
case "$1 $2" in
  "show job") echo "JobId=1 JobState=RUNNING TimeLimit=01:00:00" ;;
  "show config") echo "KillWait = 5 sec" ;;
esac
"""


@contextlib.contextmanager
def killed_on_failure(launchers: list[subprocess.Popen[str]]) -> Iterator[None]:
    """Around a two-node test's steps: on any failure every launcher's tree is SIGKILLed and their
    output printed, then the failure goes on (it is the one to report)."""
    try:
        yield
    except BaseException:
        for p in launchers:
            signal_tree(p.pid, signal.SIGKILL)
        print("\n".join((p.communicate()[0] or "")[-3000:] for p in launchers))
        raise


def node_launcher(tmp_path: Path, node: int, port: int, script: Path, args: list[str], *, spec_kw: str = "",
                  env: dict[str, str] | None = None, job_id: str = "2626", procs: int = 2) -> subprocess.Popen[str]:
    """One emulated node of a 2-node Slurm job: the real NodeLauncher, SLURM_NODEID=`node`, its
    root `tmp_path/ckpt`. Both nodes share one nonce (submitit pickles one launcher for all)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    if not (bindir / "scontrol").exists():  # the other node may be running it now: never write it twice (ETXTBSY)
        tmp = bindir / f".scontrol.{os.getpid()}"
        tmp.write_text(FAKE_SCONTROL)
        tmp.chmod(0o755)
        os.replace(tmp, bindir / "scontrol")
    kw = f", {spec_kw}" if spec_kw else ""
    code = ("import sys; from pathlib import Path; from slurmresume.job.config import JobSpec; "
            "from slurmresume.job.hang import HangBudgets; from slurmresume.job.node import NodeLauncher; "
            f"print(NodeLauncher(JobSpec(script=Path({str(script)!r}), script_args=tuple(sys.argv[1:]), "
            f"ckpt_dir=Path({str(tmp_path / 'ckpt')!r}), nodes=2, nproc_per_node={procs}, rdzv_port={port}"
            f"{kw}), nonce='submission-{job_id}')())")
    full = clean_env(PIDDIR=str(tmp_path / "pids"), PYTHONPATH=os.environ.get("PYTHONPATH", ""),
                     PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID=job_id, SLURM_NODEID=str(node),
                     SLURM_NNODES="2", **reversed_rendezvous_env(node), **(env or {}))
    return subprocess.Popen([sys.executable, "-c", code, *args], env=full, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def finish_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[str]:
    """Every launcher's output once it ended (`timeout`: a hang guard; the trees are killed)."""
    deadline = time.monotonic() + timeout
    outs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                signal_tree(proc.pid, signal.SIGKILL)
    return outs


def agent_started(launcher: int, timeout: float = 60.0) -> None:
    """Until the launcher's torchrun agent exists (the other node then starts late)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("the first launcher never started torchrun")


def global_rank_pid(launchers: list[subprocess.Popen[str]], rank: int, script: bytes = b"train.py") -> int | None:
    """The pid of global rank `rank` (RANK=`rank`) running `script` under any of `launchers`."""
    want = f"RANK={rank}".encode()
    for launcher in launchers:
        for pid in process_tree(launcher.pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if script in cmd and want in env:
                return pid
    return None


def requeued(tmp_path: Path, script: Path, args: list[str], env: dict[str, str], job_id: str
             ) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """The requeued job, as Slurm would start it after a node was lost: both emulated nodes again
    (node 1 first), restart 1, run to their end (a hang guard of 600 s). Returns the launchers
    [node 0, node 1] and their output."""
    from helpers.procs import free_port

    env = {**env, "SLURM_RESTART_COUNT": "1"}
    port = free_port()
    again = [node_launcher(tmp_path, 1, port, script, args, env=env, job_id=job_id)]
    agent_started(again[0].pid)
    again.insert(0, node_launcher(tmp_path, 0, port, script, args, env=env, job_id=job_id))
    return again, finish_all(again, 600)


def stopped_with_memory(tmp_path: Path, args: list[str], env: dict[str, str], job_id: str, rank: int | None,
                        ) -> tuple[list[subprocess.Popen[str]], int, list[Path]]:
    """Both emulated nodes (node 1 first, so its agent gets ranks 0..procs-1) running
    helpers/unwarned_train.py with the memory tier (`--snapshot-every 1`, each node its own
    $SLURMRESUME_MEMORY_BASE, tmp_path/shm<node>), until global rank `rank` stopped itself:
    ([launcher of node 0, of node 1], that rank's pid, [each node's memory root]). `rank` None:
    until both memory roots exist, the ranks still running (pid 0). On any failure every tree is
    killed and their output printed."""
    from helpers.procs import HELPERS, free_port

    port = free_port()
    shm = [tmp_path / "shm0", tmp_path / "shm1"]

    def launcher(node: int) -> subprocess.Popen[str]:
        shm[node].mkdir()
        return node_launcher(tmp_path, node, port, HELPERS / "unwarned_train.py", args, job_id=job_id,
                             spec_kw="snapshot_every='1'", env={**env, "SLURMRESUME_MEMORY_BASE": str(shm[node])})

    launchers = [launcher(1)]
    with killed_on_failure(launchers):
        agent_started(launchers[0].pid)
        launchers.insert(0, launcher(0))
        end = time.monotonic() + 600  # a hang guard only
        pid = None
        while (pid is None or _state_of(pid) != "T") if rank is not None else not all(any(d.iterdir()) for d in shm):
            assert all(p.poll() is None for p in launchers) and time.monotonic() < end, "ended before the kill"
            time.sleep(0.02)
            pid = pid or (global_rank_pid(launchers, rank) if rank is not None else None)
        return launchers, pid or 0, [next(d.iterdir()) for d in shm]


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"

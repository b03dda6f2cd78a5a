"""Running child processes in tests: a clean environment, a free port, the example training
script (one process or several ranks via torch.distributed.run), helper scripts (one process, or
several ranks forked by helpers/forkranks.py)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
HELPERS = TESTS / "helpers"
EXAMPLE = REPO / "examples" / "train.py"

# Variables that would make a child believe it runs under Slurm / torchrun, or that would arm
# the test fault seam of slurmresume/checkpoint/fsio.py without the test asking for it.
_STRIP_PREFIXES = ("SLURM_", "SLURMRESUME_", "TORCHELASTIC_", "PMI_", "OMPI_")
_STRIP_NAMES = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                "MASTER_ADDR", "MASTER_PORT"}


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without Slurm / torchrun / slurmresume variables, plus `extra`. One thread
    per process keeps multi-process tests fast on a small machine (and results identical).
    The memory tier (issue 49) is off unless a test asks for it (SLURMRESUME_MEMORY_BASE=<dir>):
    the tests of the file tier's restarts assert on the steps the file tier holds."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_STRIP_PREFIXES) and k not in _STRIP_NAMES}
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "PYTHONHASHSEED": "0", "SLURMRESUME_MEMORY_BASE": "none"})
    env.update(extra)
    return env


def reversed_rendezvous_env(node: int) -> dict[str, str]:
    """The environment that makes emulated node `node` of two (both on this host) rendezvous in
    the reverse of the Slurm order: SLURM_NODEID 1 gets ranks 0..procs-1. c10d ranks the nodes by
    (address, agent pid); two agents on one host share an address (socket.getfqdn()), so the pids
    alone decided, and pids wrap (pid_max is 32768 here): an agent started later can get the
    lower pid, and the order was then the Slurm order (a CI run saw it). Two spellings of this
    host, "127.0.0.1" < "localhost" (torchrun reads --local-addr from PET_LOCAL_ADDR), make the
    order certain; node 1's address is the one every worker connects to as rank 0's."""
    return {"PET_LOCAL_ADDR": "127.0.0.1" if node == 1 else "localhost"}


def rank_places(piddir: Path, run_id: str) -> dict[int, tuple[int, int]]:
    """Global rank -> (SLURM_NODEID, LOCAL_RANK), as each rank of run `run_id` wrote it
    (helpers/hang_train.py's $PIDDIR/where-<run id>-<R>)."""
    out = {}
    for p in piddir.glob(f"where-{run_id}-*"):
        f = dict(kv.split("=") for kv in p.read_text().split())
        out[int(f["RANK"])] = (int(f["SLURM_NODEID"]), int(f["LOCAL_RANK"]))
    return out


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_python(args: Sequence[str | os.PathLike[str]], *, env: dict[str, str] | None = None,
               timeout: float = 120, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`python args...` with a clean environment; output captured as text."""
    return subprocess.run([sys.executable, *map(str, args)], env=env if env is not None else clean_env(),
                          cwd=str(cwd or REPO), capture_output=True, text=True, timeout=timeout)


def run_example(ckpt_dir: Path, *args: str | int, nproc: int = 1, env: dict[str, str] | None = None,
                timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run examples/train.py (one process, or `nproc` ranks via torch.distributed.run --standalone,
    gloo on CPU) with --ckpt-dir `ckpt_dir`."""
    script_args = [*map(str, args), "--ckpt-dir", str(ckpt_dir)]
    if nproc == 1:
        cmd: list[str] = [str(EXAMPLE), *script_args]
    else:
        cmd = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "--max-restarts=0", "--monitor-interval=0.2", str(EXAMPLE), *script_args]
    return run_python(cmd, env=env, timeout=timeout)


def run_ranks(nproc: int, script: str | os.PathLike[str], *args: str | os.PathLike[str],
              env: dict[str, str] | None = None, timeout: float = 240,
              preload: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """`script args...` as `nproc` local gloo ranks forked from one process that imported torch
    (and `preload`, e.g. torch._dynamo for a script that makes an optimizer) once
    (helpers/forkranks.py: torchrun's variables, the first failed rank ends the others, exit 1),
    for tests of the checkpoint library across ranks; a test of the launch uses torchrun."""
    env = dict(env if env is not None else clean_env(), FORKRANKS_PRELOAD=",".join(preload))
    return run_python([HELPERS / "forkranks.py", str(nproc), script, *args], env=env, timeout=timeout)


def check(proc: subprocess.CompletedProcess[str], rc: int = 0) -> subprocess.CompletedProcess[str]:
    """Assert an exit code, showing the child's output when it differs."""
    assert proc.returncode == rc, (
        f"exit code {proc.returncode}, expected {rc}\n--- stdout ---\n{proc.stdout[-4000:]}"
        f"\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc


_LOSS_RE = re.compile(r"^step (\d+) loss (\S+) lr (\S+)$", re.MULTILINE)
_DONE_RE = re.compile(r"^done at step (\d+), final loss (\S+)$", re.MULTILINE)
_START_RE = re.compile(r"^rank 0 of (\d+): starting at step (\d+)", re.MULTILINE)


def printed_losses(stdout: str) -> dict[int, str]:
    """{step: "loss lr"} from examples/train.py's progress lines (exact printed text)."""
    return {int(m.group(1)): f"{m.group(2)} {m.group(3)}" for m in _LOSS_RE.finditer(stdout)}


def printed_final(stdout: str) -> tuple[int, str] | None:
    m = _DONE_RE.search(stdout)
    return (int(m.group(1)), m.group(2)) if m else None


def printed_start(stdout: str) -> tuple[int, int] | None:
    """(world size, starting step) from the example's first line."""
    m = _START_RE.search(stdout)
    return (int(m.group(1)), int(m.group(2))) if m else None


def process_tree(root: int) -> list[int]:
    """`root` and every process below it, found by walking /proc/<pid>/task/*/children (not the
    process group: torchrun starts each rank in its own session)."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                todo.extend(int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split())
            except (OSError, ValueError):
                continue
    return seen


def signal_tree(root: int, sig: int, *, top_first: bool = False) -> list[int]:
    """Send `sig` to every process of the tree under `root` (what proctrack/linuxproc does),
    the deepest first (SIGKILL then leaves no child to a dead parent); returns the pids.
    `top_first`: `root` first, then down the tree (a node lost whole: its launcher must not see
    its ranks die)."""
    pids = process_tree(root)
    for pid in pids if top_first else reversed(pids):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return pids


def find_processes(cmd_has: bytes, env_has: tuple[bytes, ...] = (), state: str | None = None) -> list[int]:
    """Live processes, machine-wide, whose command line holds `cmd_has` and whose environment holds
    every entry of `env_has` (whole NAME=value entries); `state`: only those in that /proc state
    (T: stopped)."""
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if cmd_has not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            now = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if state else None
        except (OSError, IndexError):
            continue
        if now == state and all(e in env for e in env_has):
            out.append(pid)
    return out


def finish(proc: subprocess.Popen[str], timeout: float = 900) -> str:
    """Wait for `proc` (stdout piped, text) and return its output; it must exit 0. The timeout is
    a hang guard only: past it the whole tree is SIGKILLed and TimeoutExpired raised."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_tree(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out[-5000:]
    return out


def rank_pid(launcher: int, rank: int, script: bytes = b"train.py") -> int | None:
    """The pid of one-node rank `rank` (RANK and LOCAL_RANK both `rank`) running `script` in the
    tree under `launcher`, or None."""
    for pid in process_tree(launcher):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if script in cmd and f"RANK={rank}".encode() in env and f"LOCAL_RANK={rank}".encode() in env:
            return pid
    return None


def alive_for_root(marker: str, root: Path) -> list[int]:
    """Live processes running `marker` (in their command line) for one test's run: their
    environment names `root` or a path under it. Other tests, e.g. on another xdist worker or the
    real-Slurm chains, run the same helper script or example at the same time, so a machine-wide
    scan by command line alone reports their processes as this test's orphans."""
    out = []
    needle = str(root)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and any(f"={needle}" in var for var in env.split("\0")):
            out.append(int(pid))
    return out

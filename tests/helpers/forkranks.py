"""Run a test helper script as N local gloo ranks forked from one process that imported torch
once, in place of `torchrun --standalone --nproc-per-node=N script args...`:

    python3 tests/helpers/forkranks.py N SCRIPT [ARGS...]    (tests call procs.run_ranks)

For tests of the checkpoint library across ranks, not of the launch: each torchrun rank is a
fresh interpreter that imports torch (about 2 CPU-s each here; torchrun itself as much again),
while a forked rank starts with torch imported. A 4-rank save: 16.5 CPU-s under torchrun, 6.5
forked (docs/architecture.md, "Where the suite's time goes").

Each rank gets torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR, MASTER_PORT; OMP_NUM_THREADS=1 for more than one rank,
as torchrun sets it), its own session (as torchrun's ranks), dies with the runner, runs the
script as __main__ and ends as an interpreter does. slurmresume is NOT imported before the
fork: its test seams (SLURMRESUME_TEST_KILL_AT / FAIL_AT) are read at import, after the script
set them per rank. MASTER_PORT was free a moment before the fork (as procs.free_port).

As torchrun with --max-restarts=0: the first rank that fails (non-zero exit or a signal) ends
the others (SIGTERM, SIGKILL 5 s later), and the exit status is 1; 0 when every rank exits 0."""

from __future__ import annotations

import atexit
import importlib
import os
import runpy
import signal
import socket
import sys
import threading
import time

if __name__ == "__main__" and int(sys.argv[1]) > 1:  # as torchrun does for more than one rank, before
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # torch reads it

import torch  # noqa: E402, F401  the point: imported once, before the ranks fork
import torch.distributed  # noqa: E402, F401
import torch.distributed.tensor  # noqa: E402, F401

PRELOAD = "FORKRANKS_PRELOAD"  # more modules to import before the fork, comma separated (torch._dynamo:
# a script that makes an optimizer imports it, ~2 CPU-s per process); never slurmresume (see above)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent(parent: int) -> None:
    """A rank outlives no runner killed by a test's timeout: SIGKILL when the parent dies (Linux)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def _rank(rank: int, world: int, port: int, script: str, args: list[str], parent: int) -> None:
    """In the forked child: torchrun's environment, the script as __main__, then the end of an
    interpreter (its non-daemon threads joined, its atexit handlers run); never returns."""
    code = 0
    try:
        os.setsid()
        _die_with_parent(parent)
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                           "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python3 script`
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed as a rank's traceback, the exit status says it failed
        import traceback

        traceback.print_exc()
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()  # as the interpreter sets them
        code = 1
    try:  # the interpreter's own exit, as a torchrun rank ends: wait for non-daemon threads, then atexit
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str]) -> int:
    world, script, args = int(argv[0]), argv[1], argv[2:]
    for name in filter(None, os.environ.pop(PRELOAD, "").split(",")):
        importlib.import_module(name)
    port = _free_port()
    sys.stdout.flush()
    sys.stderr.flush()
    pids, parent = [], os.getpid()
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank(rank, world, port, script, args, parent)
        pids.append(pid)
    failed = False
    left = set(pids)
    deadline: float | None = None
    while left:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if deadline is not None and time.monotonic() > deadline:
                for p in left:
                    os.kill(p, signal.SIGKILL)
                deadline = None
            time.sleep(0.02)
            continue
        left.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed = True  # as torchrun: the first failure ends the other ranks
            for p in left:
                os.kill(p, signal.SIGTERM)
            deadline = time.monotonic() + 5.0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

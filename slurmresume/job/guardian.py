"""Nothing outlives its launcher: a small guardian process that kills the training process tree
when the launcher goes away, however it goes (exit, crash, SIGKILL).

Why a separate process: torchrun starts every rank in its own session, so killing the launcher's
process group misses them, and a SIGKILLed launcher runs no cleanup at all. PR_SET_PDEATHSIG is
not enough either (it fires on the death of the parent *thread*, for the direct parent only).

How: the launcher starts `python -m slurmresume.job.guardian` in its own session (Ctrl-C and a
`killpg` of the launcher do not reach it) with a pipe on its stdin whose write end only the
launcher holds (non-inheritable, so torchrun never gets a copy). The launcher writes the pid of
each torchrun agent it starts. The guardian keeps walking those trees (`/proc/<pid>/task/*/
children`), remembering every (pid, start time) it has seen, so that a rank re-parented after its
agent died is still known. On EOF (the launcher exited or was killed) it stops every remembered
process that is still the same process (pid and start time), walks once more for late children,
and SIGKILLs them all. A pid reused by an unrelated process has another start time: never touched.

Two windows closed in the child itself, before it execs torchrun (`Guardian.preexec`):
- it writes its own pid into the guardian's pipe, so a launcher SIGKILLed between `Popen` and
  `track()` still leaves the guardian knowing the agent (the child holds a copy of the write end
  until its exec, so the guardian cannot see EOF before that pid);
- it becomes a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`, kept across exec): a process of
  the tree that double-forks (a child that forks and exits within one walk) leaves its orphan to
  the agent, not to init, so the next walk still finds it. Limit: an orphan made while the agent
  itself is gone, or one that left through setsid and a second fork after the agent died, is
  only Slurm's cgroup's to kill.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import IO, Any

from ..identity import start_ticks as start_time

POLL_S = 0.25
PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except OSError:
            pass
    return out


def walk(known: dict[int, int]) -> None:
    """Add every live descendant of the known processes to `known` (pid -> start time)."""
    todo = [p for p in known if start_time(p) == known[p]]
    while todo:
        pid = todo.pop()
        for child in children(pid):
            if child not in known:
                st = start_time(child)
                if st is not None:
                    known[child] = st
                    todo.append(child)


def _signal_same(known: dict[int, int], sig: int) -> None:
    for pid, st in known.items():
        if start_time(pid) == st:
            try:
                os.kill(pid, sig)
            except OSError:
                pass


def kill_tree(known: dict[int, int]) -> None:
    """Freeze (no new children can appear), collect the whole tree, SIGKILL it."""
    walk(known)
    for _ in range(3):
        _signal_same(known, signal.SIGSTOP)
        before = len(known)
        walk(known)
        if len(known) == before:
            break
    _signal_same(known, signal.SIGKILL)


def main() -> None:
    for s in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(s, signal.SIG_IGN)
    known: dict[int, int] = {}
    buf = b""
    while True:
        ready, _, _ = select.select([0], [], [], POLL_S)
        if ready:
            data = os.read(0, 4096)
            if not data:
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.strip().isdigit():
                    st = start_time(int(line))
                    if st is not None:
                        known[int(line)] = st
        walk(known)
        known = {p: st for p, st in known.items() if start_time(p) == st}
    kill_tree(known)


def _prctl() -> Any:
    """libc's prctl, or None off Linux/glibc (then orphans of a double fork are not kept)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class Guardian:
    """The launcher's handle: `track(pid)` after starting torchrun; `close()` (or the launcher's
    death) makes the guardian kill whatever of the tracked trees is still alive, then exit."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._stdin: IO[bytes] | None = None
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "slurmresume.job.guardian"], stdin=subprocess.PIPE,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True, close_fds=True)
            self._stdin = self.proc.stdin
        except OSError:
            self.proc = None

    def preexec(self, inner: Callable[[], None] | None = None) -> Callable[[], None]:
        """A `preexec_fn` for the agent's Popen: `inner`, then in the child, before its exec,
        become a child subreaper and write its own pid to the guardian (see the module doc).
        Everything it needs is resolved here, in the parent."""
        fd = self._stdin.fileno() if self._stdin is not None else None
        prctl = _prctl()

        def run() -> None:
            if inner is not None:
                inner()
            if prctl is not None:
                prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
            if fd is not None:
                try:
                    os.write(fd, b"%d\n" % os.getpid())
                except OSError:
                    pass

        return run

    def track(self, pid: int) -> None:
        if self._stdin is None:
            return
        try:
            self._stdin.write(f"{pid}\n".encode())
            self._stdin.flush()
        except OSError:
            pass

    def close(self) -> None:
        if self._stdin is not None:
            try:
                self._stdin.close()
            except OSError:
                pass
            self._stdin = None
        if self.proc is not None:
            try:  # let it finish its sweep (normally nothing is left), so it is reaped, not a zombie
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


if __name__ == "__main__":
    main()

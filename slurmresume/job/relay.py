"""The launcher's signal handling: flag-only handlers for the warning, SIGTERM and SIGINT
(`Relay`), a wake-up pipe so the relay loop forwards a signal when it comes, and the worker
processes the signal is forwarded to (`worker_pids`)."""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Any


def worker_pids(agent_pid: int) -> list[int]:
    """The agent's direct children: the rank processes (DataLoader workers are their children)."""
    pids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{agent_pid}/task"):
            with open(f"/proc/{agent_pid}/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


class Relay:
    """Flag-only handlers in the launcher (the warning, SIGTERM, SIGINT); `pump()`-style normal
    code in `run_torchrun` forwards what arrived. Installed first thing, before any Slurm call.
    Each handler also writes a byte to a pipe that `wait()` watches, so the relay loop forwards
    a signal when it comes, not at its next turn."""

    def __init__(self, warn: signal.Signals) -> None:
        self.warn = warn
        self.pending: set[int] = set()
        self.seen: list[int] = []
        self.term_at: float | None = None  # time.time() of the first SIGTERM
        self.interrupts = 0
        self._previous: dict[int, Any] = {}
        self._wake: tuple[int, int] | None = None  # (read, write) ends of the wake-up pipe

    def _handler(self, signum: int, frame: object) -> None:
        self.pending.add(signum)
        self.seen.append(signum)
        if signum == signal.SIGTERM and self.term_at is None:
            self.term_at = time.time()
        if signum == signal.SIGINT:
            self.interrupts += 1
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")
            except OSError:  # full (a wake-up is pending anyway) or closed
                pass

    def install(self) -> None:
        if self._wake is None:
            self._wake = os.pipe()
            for fd in self._wake:
                os.set_blocking(fd, False)
        for s in {self.warn, signal.SIGTERM, signal.SIGINT}:
            self._previous[s] = signal.signal(s, self._handler)

    def uninstall(self, *, ignore_warning: bool = False) -> None:
        """Restore the previous handlers. `ignore_warning`: the warning is ignored from now on
        instead (its default action kills the process): for a launcher whose process lives on
        only to exit, since Slurm may send the `@lead` warning up to a minute early, after the
        run has finished, and a task killed by it turns a completed job into a failed one."""
        for s, prev in self._previous.items():
            signal.signal(s, signal.SIG_IGN if ignore_warning and s == self.warn else prev)
        self._previous.clear()
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def wait(self, timeout: float, pid_fd: int | None = None) -> bool:
        """Sleep up to `timeout`; back early when one of our signals arrives or the process behind
        `pid_fd` (a pidfd) exits. True when `pid_fd` is readable (the process has exited)."""
        fds = [fd for fd in (self._wake[0] if self._wake else None, pid_fd) if fd is not None]
        if not fds:
            time.sleep(timeout)
            return False
        poller = select.poll()  # not select(): no limit on the descriptors' numbers
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = [fd for fd, _ in poller.poll(timeout * 1000)]
        if self._wake is not None and self._wake[0] in ready:
            try:
                while os.read(self._wake[0], 512):
                    pass
            except OSError:  # drained
                pass
        return pid_fd is not None and pid_fd in ready

    def strongest(self) -> int | None:
        """What the workers are told: the warning, else SIGTERM (for a SIGTERM or a SIGINT)."""
        if self.warn in self.pending:
            return self.warn
        return signal.SIGTERM if self.pending & {signal.SIGTERM, signal.SIGINT} else None

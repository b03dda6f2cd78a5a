"""Flag-only signal handlers, and the agreement of all ranks at a step boundary.

A handler never does work: it records that a signal came. All work (agreeing, saving,
exiting) happens later, in normal code, at `Checkpointer.step()`.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from types import FrameType
from typing import Any

from ..contract import ENV_SIGNAL, parse_signal
from ..contract import EXIT_PREEMPTED as EXIT_PREEMPTED  # re-exported (slurmresume.EXIT_PREEMPTED)
from ..contract import EXIT_TERMINATED as EXIT_TERMINATED  # re-exported

log = logging.getLogger("slurmresume")

NONE, TERMINATE, PREEMPT = 0, 1, 2  # ordered: the MAX over ranks is what everyone acts on



def warning_signal_from_env() -> signal.Signals:
    return parse_signal(os.environ.get(ENV_SIGNAL, "USR1"))


class SignalFlag:
    """Records the strongest request seen. Install from the main thread of the main process;
    `uninstall()` restores the previous handlers and signal mask.

    No child of the process can die of the warning signal: `install()` blocks it in the main
    thread, and a blocked mask is inherited across fork AND exec (a Python handler is not), so a
    DataLoader worker started by fork, spawn or forkserver, or any subprocess started from the
    main thread, keeps it pending instead of taking the default action (USR1's kills). The
    process itself still receives it: a dedicated thread waits for it with `sigwait`, and the
    handler stays installed for threads that started before `install()` and still accept it
    (gloo's, torch's). A forked child gets the previous handlers back (`os.register_at_fork`),
    so SIGTERM stops it again (`Process.terminate()`, `multiprocessing.Pool` shutdown), and
    keeps the warning blocked."""

    def __init__(self, warn: signal.Signals, handle_term: bool = True) -> None:
        self.warn = warn
        self.handle_term = handle_term
        self.request = NONE
        self.received: list[int] = []
        self._owner = os.getpid()
        self._previous: dict[signal.Signals, Any] = {}
        self._blocked_before = True
        self._waiter: threading.Thread | None = None
        self._stop = False

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:
            return  # a forked child (DataLoader worker): the main process acts, not us
        self._record(signum)

    def _record(self, signum: int) -> None:
        self.received.append(signum)
        level = PREEMPT if signum == self.warn else TERMINATE
        self.request = max(self.request, level)

    def _wait_loop(self) -> None:
        while True:
            signum = signal.sigwait({self.warn})
            if self._stop:
                return
            # the newest installed flag acts (a script may hold an older, unclosed Checkpointer)
            newest = next((f for f in reversed(_INSTALLED) if f.warn == self.warn), self)
            newest._record(signum)

    def install(self) -> bool:
        """Returns False (and installs nothing) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        sigs = [self.warn] + ([signal.SIGTERM] if self.handle_term and self.warn != signal.SIGTERM else [])
        for s in sigs:
            self._previous[s] = signal.signal(s, self._handler)
        self._blocked_before = self.warn in signal.pthread_sigmask(signal.SIG_BLOCK, {self.warn})
        self._stop = False
        self._waiter = threading.Thread(target=self._wait_loop, name="slurmresume-signal", daemon=True)
        self._waiter.start()  # inherits the blocked mask, which sigwait requires
        _INSTALLED.append(self)
        _register_fork_hook()
        return True

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread() or not self._previous:
            return
        if self._waiter is not None and self._waiter.is_alive():
            self._stop = True
            signal.pthread_kill(self._waiter.ident or 0, self.warn)  # wakes sigwait, which returns
            self._waiter.join(timeout=5)
        self._waiter = None
        if not self._blocked_before:
            # a warning that arrived since the waiter stopped is still pending: take it with our
            # handler, which is still installed, before the previous disposition is back
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.warn})
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()
        if self in _INSTALLED:
            _INSTALLED.remove(self)

    def restore_in_child(self) -> None:
        """After fork, in the child: the previous dispositions back; the warning stays blocked."""
        for s, prev in self._previous.items():
            try:
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, OSError):  # forked from a thread other than the main one
                pass
        signal.pthread_sigmask(signal.SIG_BLOCK, {self.warn})
        self._previous.clear()
        self._waiter = None

    @property
    def installed(self) -> bool:
        return bool(self._previous)


def install_flag(handle_signals: bool) -> SignalFlag | None:
    """The warning flag for `Checkpointer(handle_signals=...)`, installed; None when not asked or
    not in the main thread (logged: no handler can be installed there)."""
    if not handle_signals:
        return None
    flag = SignalFlag(warning_signal_from_env())
    if flag.install():
        return flag
    log.warning("not in the main thread: warning-signal handlers not installed")
    return None


_INSTALLED: list[SignalFlag] = []  # installed and not uninstalled, oldest first
_FORK_HOOK = False


def _after_fork_in_child() -> None:
    while _INSTALLED:  # newest first, so the oldest's previous dispositions end up in place
        _INSTALLED.pop().restore_in_child()


def _register_fork_hook() -> None:
    global _FORK_HOOK
    if not _FORK_HOOK:
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _FORK_HOOK = True


def ignore_in_worker(worker_id: int = 0) -> None:
    """`DataLoader(worker_init_fn=slurmresume.ignore_in_worker)`: a data worker ignores the
    warning signal so that only the training process decides (a spawned worker would otherwise
    die of the default action). SIGTERM is left alone: DataLoader stops its workers with it."""
    signal.signal(warning_signal_from_env(), signal.SIG_IGN)

"""Flag-only signal handlers, and the agreement of all ranks at a step boundary.

A handler never does work: it records that a signal came. All work (agreeing, saving,
exiting) happens later, in normal code, at `Checkpointer.step()`.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType
from typing import Any

from .contract import ENV_SIGNAL, EXIT_PREEMPTED, EXIT_TERMINATED  # noqa: F401 - re-exported

NONE, TERMINATE, PREEMPT = 0, 1, 2  # ordered: the MAX over ranks is what everyone acts on



def parse_signal(name: str | int | signal.Signals) -> signal.Signals:
    """`USR1`, `SIGUSR1`, `10` or a Signals member -> Signals; ValueError on anything else."""
    if isinstance(name, signal.Signals):
        return name
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        return signal.Signals(int(name))
    key = name.upper()
    key = key if key.startswith("SIG") else f"SIG{key}"
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}: use a name like USR1 or SIGUSR2") from None


def warning_signal_from_env() -> signal.Signals:
    return parse_signal(os.environ.get(ENV_SIGNAL, "USR1"))


class SignalFlag:
    """Records the strongest request seen. Install from the main thread of the main process;
    `uninstall()` restores the previous handlers. A process forked from the owner (a DataLoader
    worker) ignores the signal instead of acting on it."""

    def __init__(self, warn: signal.Signals, handle_term: bool = True) -> None:
        self.warn = warn
        self.handle_term = handle_term
        self.request = NONE
        self.received: list[int] = []
        self._owner = os.getpid()
        self._previous: dict[signal.Signals, Any] = {}

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._owner:
            return  # a forked child (DataLoader worker): the main process acts, not us
        self.received.append(signum)
        level = PREEMPT if signum == self.warn else TERMINATE
        self.request = max(self.request, level)

    def install(self) -> bool:
        """Returns False (and installs nothing) outside the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        sigs = [self.warn] + ([signal.SIGTERM] if self.handle_term and self.warn != signal.SIGTERM else [])
        for s in sigs:
            self._previous[s] = signal.signal(s, self._handler)
        return True

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for s, prev in self._previous.items():
            signal.signal(s, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def installed(self) -> bool:
        return bool(self._previous)


def ignore_in_worker(worker_id: int = 0) -> None:
    """`DataLoader(worker_init_fn=slurmresume.ignore_in_worker)`: a data worker ignores the
    warning signal so that only the training process decides (a spawned worker would otherwise
    die of the default action). SIGTERM is left alone: DataLoader stops its workers with it."""
    signal.signal(warning_signal_from_env(), signal.SIG_IGN)

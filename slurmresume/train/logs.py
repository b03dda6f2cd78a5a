"""The training log: one line per event a user cares about (restored, warning received, saved,
requeueing), from the `slurmresume` logger.

`ensure_handler()` (called by `Checkpointer`) gives that logger a stderr handler at INFO when
the program configured no logging at all, so the lines reach the job's log without any setup;
a program that configures logging (root handlers) keeps full control.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "slurmresume"
FORMAT = "%(asctime)s slurmresume: %(message)s"


def ensure_handler() -> None:
    log = logging.getLogger(LOGGER)
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, "%H:%M:%S"))
    log.addHandler(handler)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    log.propagate = False


def size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"

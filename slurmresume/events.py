"""The append-only event log next to the checkpoints (JSON lines), written by rank 0 / launchers."""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from .checkpoint.fsio import makedirs
from .checkpoint.layout import EVENTS
from .identity import start_ticks

MAX_EVENT_LOG = 64 << 20  # read_events reads at most this much, from the end of the log
log = logging.getLogger("slurmresume")


def append_event(root: Path, name: str, /, **fields: Any) -> None:
    """Append one event. A single O_APPEND write keeps lines whole across processes."""
    record = {
        "time": time.time(),
        "event": name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT") or os.environ.get("SLURMRESUME_RESTART_COUNT") or 0),
        **fields,
    }
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    makedirs(root, 0o755)
    path = root / EVENTS
    odd = f"event log {path} is not a regular file (a link, FIFO or device?): remove it"
    try:  # O_NONBLOCK: a FIFO planted in its place fails here (ENXIO) instead of blocking forever
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise OSError(exc.errno, odd, str(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, odd, str(path))
        os.write(fd, line)
    finally:
        os.close(fd)


def process_started_at(pid: int | None = None) -> float | None:
    """When a process started (default: this one), as a time.time(): the kernel's start time
    (/proc/<pid>/stat field 22, clock ticks since boot, 10 ms resolution) moved onto the wall
    clock through CLOCK_BOOTTIME, the clock it counts on. (`btime` in /proc/stat is whole
    seconds: btime + ticks was early by the boot's fraction of a second, up to 1 s.) For the
    start-up breakdown in the event log (the interpreter and imports before any of our code
    runs); None where /proc cannot tell."""
    ticks = start_ticks(pid or "self")
    if ticks is None:
        return None
    try:
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):  # AttributeError: no CLOCK_BOOTTIME
        return None


def try_append_event(root: Path, name: str, /, **fields: Any) -> bool:
    """`append_event` for the launcher: a log that cannot be written (disk full, EIO) is reported
    and never changes what the launcher does."""
    try:
        append_event(root, name, **fields)
        return True
    except OSError as exc:
        log.warning("could not append %r to the event log under %s: %s", name, root, exc)
        return False


def read_events(root: Path) -> list[dict[str, Any]]:
    """The well-formed events of the log's last MAX_EVENT_LOG bytes, oldest first; a torn or
    foreign line is skipped. The log is the human history: no decision of the launcher reads it,
    and a huge log costs a bounded read (its newest events, not its first 64 MiB)."""
    path = root / EVENTS
    try:  # never follow a link, never block on a FIFO, never read a device
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("ignoring event log %s: %s (a symbolic link?)", path, exc.strerror)
        return []
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        log.warning("ignoring event log %s: not a regular file", path)
        return []
    with os.fdopen(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start = max(0, size - MAX_EVENT_LOG)
        f.seek(start)
        data = f.read(MAX_EVENT_LOG)
    if start > 0:  # we landed inside a line: drop it
        data = data[data.find(b"\n") + 1:] if b"\n" in data else b""
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            out.append(rec)
    return out

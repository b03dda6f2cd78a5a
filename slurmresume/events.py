"""The append-only event log next to the checkpoints (JSON lines), written by rank 0 / launchers,
and its vocabulary: every event name (`EV_*`, the strings on disk) is declared here and nowhere
else (scripts/import_graph.py checks it); each estimate read back from the log is made by a
reader below or in the module that owns it, with the names from here.

The log is the human history. It is read back for estimates only, never for what to do with a
run: the hang watch's save budget and the auto save interval (`save_seconds`), a mirror pull's
expected rate (`logged_pull_rate`), and `submit`'s `--signal-lead` warning
(`job.leadtime`)."""

from __future__ import annotations

import errno
import json
import logging
import math
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from .beatfile import IO_MEASURE_MIN_BYTES
from .checkpoint.fsio import makedirs
from .checkpoint.layout import EVENTS
from .identity import start_ticks

# -- the vocabulary: one name per kind of event, as written on disk ---------------------------
# the node launcher (job/node.py, job/torchrun.py)
EV_STARTED = "started"  # a run began (every node's launcher logs it; node 0's is the run's)
EV_RUN_ENDED = "run_ended"  # a run ended: its outcome, the launcher's action and why, how far its ranks got
EV_REQUEUED = "requeued"  # the job was requeued (scontrol requeue worked), or a local rerun
EV_REQUEUE_FAILED = "requeue_failed"  # every `scontrol requeue` attempt failed before the deadline
EV_FINISHED = "finished"  # the job ended: the run finished (or the mirror stayed behind)
EV_GAVE_UP = "gave_up"  # the job ended: too many restarts without progress
EV_STOPPED = "stopped"  # the job ended: a stop the launcher was told or decided
EV_FAILED = "failed"  # a run failed (a non-zero exit that was no preemption)
EV_NO_CHECKPOINT = "no_checkpoint"  # the run finished and no complete checkpoint exists
EV_WARNED_WITHOUT_SAVE = "warned_without_save"  # the warning came, the run ended, nothing saved
EV_INTERRUPTED = "interrupted"  # SIGINT (Ctrl-C) reached the launcher: best-effort save, no requeue
EV_SIGTERM = "sigterm"  # SIGTERM reached the launcher (its meaning: preempt or terminate)
EV_SIGNAL_FORWARDED = "signal_forwarded"  # the warning signal relayed to the workers
EV_HANG = "hang"  # a rank made no progress within its phase's budget: stacks dumped, run killed
# the first step after an in-allocation restart (seconds since the death/kill), or after a requeue
# (cause "requeue": seconds since the requeued launcher's process started; locally, since the
# previous run ended)
EV_RESUMED = "resumed"
EV_HELD = "held"  # the same hang twice without progress: the job is held (scontrol requeuehold)
# rank 0 (train/)
EV_SAVE_COMMITTED = "save_committed"  # a checkpoint committed: step, seconds, bytes, reason, ...
EV_SAVE_FAILED = "save_failed"  # a save failed: nothing new committed
EV_SIGNAL_AGREED = "signal_agreed"  # the ranks agreed on the step to save at after a warning
EV_EXIT_AFTER_SAVE = "exit_after_save"  # the emergency save committed: the ranks exit
EV_EMERGENCY_SAVE_FAILED = "emergency_save_failed"  # rank 0: the save after a signal failed
EV_RESTORED = "restored"  # a checkpoint was restored (step, seconds, the start-up breakdown)
EV_FAILURE_SAVE = "failure_save"  # survivors of an unwarned failure: committed, or the missing pieces
EV_MEMORY_REFUSED = "memory_refused"  # a memory-tier snapshot would not fit the node's memory: the tier is off
EV_MEMORY_FALLBACK = "memory_fallback"  # the memory tier's snapshot did not load: restored from the file tier
EV_MEMORY_PROMOTED = "memory_promoted"  # a node lost: a memory snapshot copied to the root and committed (job/promote.py)
EV_ROOT_CONFLICT = "root_conflict"  # the script's root is not the launcher's (logged under the launcher's)
# the mirror (mirror/background.py)
EV_MIRROR_UPLOADED = "mirror_uploaded"
EV_MIRROR_DOWNLOADED = "mirror_downloaded"  # a pull: bytes and seconds (the pull rate's source)
EV_MIRROR_FAILED = "mirror_failed"
EV_MIRROR_CONFLICT = "mirror_conflict"
EV_MIRROR_BEHIND = "mirror_behind"  # the last committed step did not reach the mirror
MIRROR_PREFIX = "mirror_"  # every mirror event's name starts so
# the command line (cli/, tools/)
EV_SUBMITTED = "submitted"  # `slurmresume submit`: a new job on this root (its signal lead)
EV_DISCARDED_NEWER = "discarded_newer"  # `branch --discard-newer`: the steps after the one kept
EV_BRANCHED = "branched"  # a new root started from another root's step

NAMES = frozenset(v for k, v in list(globals().items()) if k.startswith("EV_") and isinstance(v, str))

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
    foreign line is skipped. The log is the human history, read back for estimates only (see the
    module docstring), and a huge log costs a bounded read (its newest events, not its first
    64 MiB)."""
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


# -- typed readers: what a decision takes from the log ----------------------------------------

def save_seconds(events: list[dict[str, Any]]) -> list[float]:
    """The logged seconds of each committed save, oldest first (a save whose seconds are not a
    finite non-negative number is skipped). Pure. The hang watch's save budget
    (`job.node._watch`) and the auto save interval (`train.savepolicy.estimate_from_events`)."""
    return [float(e["seconds"]) for e in events if e.get("event") == EV_SAVE_COMMITTED and _seconds(e.get("seconds"))]


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


def logged_pull_rate(events: list[dict[str, Any]]) -> float:
    """The slowest of the last pulls from the mirror in the log (`mirror_downloaded`, bytes and
    seconds, of at least IO_MEASURE_MIN_BYTES), bytes/s; 0 when none. Pure. A mirror pull's
    expected rate in the rank's heartbeat, until it measured one (`train.wiring`)."""
    rates = [float(e["bytes"]) / float(e["seconds"]) for e in events[-200:]
             if e.get("event") == EV_MIRROR_DOWNLOADED and isinstance(e.get("bytes"), (int, float))
             and isinstance(e.get("seconds"), (int, float)) and e["bytes"] >= IO_MEASURE_MIN_BYTES
             and e["seconds"] > 0]
    return min(rates[-10:], default=0.0)

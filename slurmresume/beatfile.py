"""The heartbeat record's format: what a rank writes (train/heartbeat.py, the writer) and its node's
launcher reads (job/hang.py, job/hangwatch.py), in one base module so that neither side imports the
other's package. The channel itself is described in train/heartbeat.py.

One fixed-size file per rank, `<dir>/rank-<global rank>.hb`: a head (magic, version, seq, pid,
rank, phase index, counters, monotonic times, the longest step and save, the I/O in progress), a
ring of the last RING step durations, and the seq again at the tail: a reader drops a torn read
(it retries once, then reports nothing rather than a mix of two records).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

STARTUP, STEP, SAVE, RESTORE, DONE, BUSY = "start-up", "step", "save", "restore", "done", "busy"
PHASES = (STARTUP, STEP, SAVE, RESTORE, DONE, BUSY)  # the index is what the record stores
RING = 256
MAGIC = b"SRHB"
FORMAT_VERSION = 3
# magic, version, seq, pid, rank, phase, steps_seen, durations written (ring index = n % RING), step, time, phase_since,
# longest_step, longest_save, wall, budget_s, expect_bytes, rate (time and phase_since: monotonic; wall: time.time(),
# display only; rate: bytes/s, 0 when not measured)
HEAD_STRUCT = struct.Struct("<4sIQiiIIIqddddddqd")
IO_MEASURE_MIN_BYTES = 64 << 20  # a smaller transfer's time is mostly fixed costs: not a throughput
IO_KINDS = ("save", "restore", "pull")
RING_STRUCT = struct.Struct(f"<{RING}f")
TAIL_STRUCT = struct.Struct("<Q")
SIZE = HEAD_STRUCT.size + RING_STRUCT.size + TAIL_STRUCT.size


def record_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.hb"


def stacks_path(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.stacks"


@dataclass(frozen=True)
class Record:
    """One rank's last heartbeat, as the launcher reads it."""

    pid: int
    rank: int
    phase: str
    step: int  # the last step passed to ckpt.step() (-1: none yet)
    time: float  # time.monotonic() of the last heartbeat (system-wide: the launcher's clock too)
    phase_since: float  # when the current phase began (monotonic)
    longest_step: float  # seconds, after the warm-up steps; 0: not measured yet
    longest_save: float  # seconds, the longest save of this run (0: none yet)
    steps_seen: int  # step() calls of this process
    durations: tuple[float, ...]  # the last step durations (seconds), oldest first
    wall: float = 0.0  # time.time() of the last heartbeat: for display only, never for an age
    budget_s: float = 0.0  # the budget `ckpt.busy(..., budget_s=)` asked for (0: none)
    expect_bytes: int = 0  # the bytes the save/restore/pull in progress has to move (0: not known)
    rate: float = 0.0  # bytes/s this process measured for that kind of I/O (0: none measured yet)


def read_record(path: Path) -> Record | None:
    """The launcher. None when there is no record yet, or it is not one (torn twice, foreign)."""
    for _ in range(2):
        try:
            with open(path, "rb") as f:
                data = f.read(SIZE)
        except OSError:
            return None
        if len(data) != SIZE:
            continue
        head = HEAD_STRUCT.unpack_from(data, 0)
        if head[0] != MAGIC or head[2] != TAIL_STRUCT.unpack_from(data, HEAD_STRUCT.size + RING_STRUCT.size)[0]:
            continue
        if head[1] != FORMAT_VERSION:
            return None
        _, _, _, pid, rank, phase, steps_seen, n, step, t, since, longest, save, wall, asked, expect, rate = head
        if phase >= len(PHASES):
            return None
        raw = RING_STRUCT.unpack_from(data, HEAD_STRUCT.size)
        ring = tuple(raw[(n - min(n, RING) + i) % RING] for i in range(min(n, RING)))  # oldest first
        return Record(pid, rank, PHASES[phase], step, t, since, longest, save, steps_seen, ring, wall, asked,
                      expect, rate)
    return None


def read_all(directory: Path) -> dict[int, Record]:
    """Every rank's record in `directory`, by global rank."""
    return scan(directory)[0]


def scan(directory: Path) -> tuple[dict[int, Record], set[int]]:
    """(every rank's record in `directory` by global rank, the ranks whose record file is there
    but empty: just created, or emptied by a rank whose writes failed)."""
    out: dict[int, Record] = {}
    empty: set[int] = set()
    try:
        names = os.listdir(directory)
    except OSError:
        return out, empty
    for name in names:
        if name.startswith("rank-") and name.endswith(".hb"):
            path = Path(directory) / name
            rec = read_record(path)
            if rec is not None:
                out[rec.rank] = rec
            elif name[5:-3].isdigit() and _empty(path):
                empty.add(int(name[5:-3]))
    return out, empty


def _empty(path: Path) -> bool:
    try:
        return path.stat().st_size == 0
    except OSError:
        return False

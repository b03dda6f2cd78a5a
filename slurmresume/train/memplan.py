"""The memory tier's decisions, pure (train/memtier.py acts on them): its interval setting, the
auto interval from measured costs, whether a snapshot fits the node, when one is due, and each
rank's measurement of what snapshots cost its steps."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..contract import ENV_MEMORY_LIMIT, parse_snapshot_every
from ..errors import ConfigError

BUDGET = 0.02  # "auto": a snapshot's measured cost over its interval's steps stays under this share
MEASURE_STEPS = 5  # "auto": step() calls measured before the first snapshot, and between the first two
WINDOW = 64  # step durations kept for the median
HEADROOM_MIN = 512 << 20  # what a snapshot must leave free, at least (tmpfs and MemAvailable)
HEADROOM_SHARE = 0.05  # ... or this share of the node's memory, whichever is larger


def setting(value: Any) -> int | None:
    """`snapshot_every` as an interval: 0 off, N steps, None auto. ConfigError for anything else."""
    try:
        if isinstance(value, bool):
            raise ValueError(value)
        return parse_snapshot_every(value)
    except ValueError:
        raise ConfigError(f"snapshot_every={value!r}: give 'auto', 'off' (or 0) or a number of steps") from None


def auto_interval(cost_s: float, step_s: float, budget: float = BUDGET) -> int:
    """Pure: the fewest steps between snapshots that keep `cost_s` per snapshot at most `budget`
    of the steps' time (`step_s` each); 1 when the cost is nothing to speak of."""
    if cost_s <= 0 or step_s <= 0:
        return 1
    return max(1, math.ceil(cost_s / (budget * step_s)))


def refusal(need: int, shm_free: int | None, mem_available: int | None, mem_total: int | None,
            limit: int | None, buffers: int = 0) -> str | None:
    """Pure: why the node cannot hold a snapshot of `need` bytes (this node's ranks together), or
    None when it can. It must fit under `limit` ($SLURMRESUME_MEMORY_LIMIT_BYTES), and leave the
    headroom free on the tmpfs and in MemAvailable (tmpfs pages are RAM that no one can reclaim),
    where the writer's copy buffers not made yet (`buffers`) come out of MemAvailable too."""
    headroom = max(HEADROOM_MIN, int(HEADROOM_SHARE * (mem_total or 0)))
    if limit is not None and need > limit:
        return f"it needs {need} bytes on this node, over {ENV_MEMORY_LIMIT}={limit}"
    if shm_free is not None and need + headroom > shm_free:
        return f"it needs {need} bytes on this node + {headroom} free, and its tmpfs has {shm_free} free"
    if mem_available is not None and need + buffers + headroom > mem_available:
        return (f"it needs {need + buffers} bytes on this node (buffers included) + {headroom} free, and "
                f"MemAvailable is {mem_available}")
    return None


@dataclass
class Schedule:
    """When snapshots are due, from step numbers and step() calls only (the same on every rank)."""

    every: int | None  # N, or None: auto
    calls: int = 0  # step() calls seen by this process
    next_call: int = MEASURE_STEPS  # auto: the call at which the next snapshot is due
    agreed: int | None = None  # auto: the interval agreed at the last snapshot

    def due(self, step: int) -> bool:
        """Every rank, once per step(): is a snapshot of `step` due now?"""
        self.calls += 1
        if self.every is not None:
            return step % self.every == 0
        return self.calls >= self.next_call

    def taken(self, agreed: int) -> None:
        """Auto: a snapshot was started at this call; `agreed` is the interval every rank agreed on
        (0: none measured yet: the next after MEASURE_STEPS calls)."""
        self.agreed = agreed or None
        self.next_call = self.calls + (agreed or MEASURE_STEPS)


@dataclass
class Cost:
    """This rank's measurement of what snapshots cost training (auto): step durations while no
    snapshot is in flight, and per snapshot the copy plus the excess of the steps it overlapped."""

    clean: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    last_at: float | None = None
    blocked: float = 0.0  # the copy inside the last interval, not step time
    excess: float = 0.0
    sample: float | None = None  # the last finished snapshot's cost

    def tick(self, in_flight: bool) -> None:
        now = time.monotonic()
        if self.last_at is not None:
            dt = max(0.0, now - self.last_at - self.blocked)
            if in_flight and self.clean:
                self.excess += max(0.0, dt - statistics.median(self.clean))
            elif not in_flight:
                self.clean.append(dt)
        self.last_at, self.blocked = now, 0.0

    def finished(self, blocking_s: float) -> None:
        self.sample, self.excess = blocking_s + self.excess, 0.0

    def proposal(self) -> int:
        if self.sample is None or not self.clean:
            return 0
        return auto_interval(self.sample, statistics.median(self.clean))

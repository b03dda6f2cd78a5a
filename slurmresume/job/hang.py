"""Hang decisions, pure: how long each phase may go without a heartbeat, which ranks are stuck,
whether a hang is the same as the last one, which rank straggles. Time is always passed in, and
it is CLOCK_MONOTONIC (heartbeat.py): a wall-clock step never makes or hides a hang.

The rules (docs/hang-detection.md):
- Only a rank's own record can condemn it. A rank with no record ("unknown": it has not created
  its Checkpointer, or it cannot publish) and a rank whose record is empty ("not watched") are
  shown, never judged.
- The budgets, per rank and per phase (the CLI knob in brackets):
    start-up  (no step() yet: imports, NCCL init, data)        startup_s  (--hang-startup, 900 s)
    step      during the first `warmup_steps` steps             startup_s
              after them, auto: multiple x longest step + floor_s      (10 x + 600 s)
              after them, --hang-timeout SECONDS: that many seconds
    busy      (`with ckpt.busy("eval"):` between steps)         the larger of busy_s (--hang-busy, 900 s)
              or `ckpt.busy(..., budget_s=)`, and the rank's step budget (never less than not wrapping)
    save      (a synchronous or emergency save in progress)     save_floor_s (--hang-save, 300 s) + the larger of
                                                                save_multiple x longest save (5 x) and the bytes
                                                                term (io_factor x bytes / throughput, 3 x)
    restore   (a pull from the mirror included)                 the same with the bytes it reads or pulls,
                                                                at least startup_s
  Save and restore are counted from the later of the rank's last heartbeat and the last time the
  bytes of a save or pull in progress under the root moved (a save whose files visibly grow is alive).
The longest save is the larger of this run's and the log's recent saves (`save_cost_s`). The bytes
term: the rank publishes the bytes it is about to move (its shards' sizes before a save, the
manifest's total before a pull, its part before a restore's read) and the slowest throughput it
measured for that kind of transfer in this process (transfers of 64 MiB or more; a pull with
none: the slowest of the log's recent pulls, events.logged_pull_rate); with none known, io_rate_mbs (--hang-io-rate, 50 MB/s) is assumed. Ranks restoring on one node wait for
each other (rank 0 pulls while the others wait in a collective): each gets the largest bytes term
among them.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from ..beatfile import BUSY, RESTORE, SAVE, STARTUP, STEP, Record
from ..errors import ConfigError

STRAGGLER_MARGIN = 0.2  # a rank whose median step is 20% above the others' median is named
STRAGGLER_MIN_SAMPLES = 20
UNKNOWN, UNWATCHED = "unknown", "not watched"  # shown for ranks that are never judged


@dataclass(frozen=True, kw_only=True)
class HangBudgets:
    """How long a rank may go without a heartbeat, by phase (see the module doc)."""

    enabled: bool = True  # --hang-timeout off: False
    timeout_s: float | None = None  # --hang-timeout SECONDS: the step budget after warm-up; None: auto
    multiple: float = 10.0  # auto step budget: multiple x longest step + floor_s
    # 10 min: PyTorch's default collective timeout; an evaluation or a data reload between
    # steps that is not wrapped in ckpt.busy() gets that long before it is taken for a hang
    floor_s: float = 600.0
    warmup_steps: int = 3  # steps judged by startup_s (first steps compile, warm caches, build buckets)
    startup_s: float = 900.0  # --hang-startup
    busy_s: float = 900.0  # --hang-busy: `ckpt.busy()` without budget_s (never less than the step budget)
    save_multiple: float = 5.0  # save/restore budget: save_multiple x longest save + save_floor_s
    save_floor_s: float = 300.0  # --hang-save
    # --hang-io-rate: MB/s assumed for a save, restore or pull until this process measured one
    # (conservative: a loaded parallel file system or a bucket over a shared link)
    io_rate_mbs: float = 50.0
    io_factor: float = 3.0  # the bytes term: io_factor x bytes / throughput

    def __post_init__(self) -> None:
        for name in ("multiple", "floor_s", "startup_s", "busy_s", "save_multiple", "save_floor_s", "io_rate_mbs",
                     "io_factor"):
            value = getattr(self, name)
            if not value > 0 or value == float("inf"):
                raise ConfigError(f"hang budget {name} must be a positive number of seconds, got {value}")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ConfigError(f"--hang-timeout must be auto, off or a positive number of seconds, got {self.timeout_s}")

    def describe(self) -> str:
        if not self.enabled:
            return "off"
        step = f"{self.timeout_s:g} s" if self.timeout_s is not None else f"{self.multiple:g}x longest step + {self.floor_s:g} s"
        return (f"step: {step} (after {self.warmup_steps} warm-up steps: {self.startup_s:g} s); "
                f"start-up: {self.startup_s:g} s; busy: {self.busy_s:g} s, at least the step budget; "
                f"save: {self.save_floor_s:g} s + the larger of {self.save_multiple:g}x longest save and "
                f"{self.io_factor:g}x its bytes at the measured throughput (else {self.io_rate_mbs:g} MB/s); "
                f"restore: the same with its bytes, at least {self.startup_s:g} s")


def parse_hang_timeout(value: str) -> tuple[bool, float | None]:
    """'auto' -> (True, None); 'off' -> (False, None); '90' / '90s' -> (True, 90.0). ConfigError else."""
    text = str(value).strip().lower()
    if text == "auto":
        return True, None
    if text == "off":
        return False, None
    try:
        seconds = float(text.removesuffix("s"))
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ConfigError(f"--hang-timeout {value!r} is not valid: use auto, off or a positive number of seconds (e.g. 600)")
    return True, seconds


def step_budget(rec: Record, b: HangBudgets) -> float:
    """The budget of a rank between two step() calls (start-up during the warm-up steps)."""
    if rec.steps_seen <= b.warmup_steps or rec.longest_step <= 0:
        return b.startup_s
    if b.timeout_s is not None:
        return b.timeout_s
    return b.multiple * rec.longest_step + b.floor_s


def io_seconds(nbytes: int, rate: float, b: HangBudgets) -> float:
    """The bytes term: io_factor x the time `nbytes` take at `rate` bytes/s (0: not measured, the
    assumed io_rate_mbs instead)."""
    if nbytes <= 0:
        return 0.0
    return b.io_factor * nbytes / (rate if rate > 0 else b.io_rate_mbs * 1e6)


def restoring_io_s(records: dict[int, Record | None], b: HangBudgets) -> float:
    """The largest bytes term among the ranks restoring (the others wait for them in a collective)."""
    return max((io_seconds(r.expect_bytes, r.rate, b) for r in records.values()
                if r is not None and r.phase == RESTORE), default=0.0)


def budget(rec: Record | None, b: HangBudgets, save_cost_s: float = 0.0, peer_io_s: float = 0.0
           ) -> tuple[str, float]:
    """(phase, seconds the rank may go without a heartbeat in it). No record: never judged (inf).
    `peer_io_s`: the largest bytes term among the node's restoring ranks (they wait for each other)."""
    if rec is None:
        return UNKNOWN, float("inf")
    if rec.phase == STARTUP:
        return STARTUP, b.startup_s
    if rec.phase == BUSY:
        return BUSY, max(rec.budget_s or b.busy_s, step_budget(rec, b))
    moving = io_seconds(rec.expect_bytes, rec.rate, b)
    if rec.phase == SAVE:
        return SAVE, b.save_floor_s + max(b.save_multiple * max(rec.longest_save, save_cost_s), moving)
    if rec.phase == RESTORE:
        work = max(b.save_multiple * max(rec.longest_save, save_cost_s), moving, peer_io_s)
        return RESTORE, max(b.startup_s, b.save_floor_s + work)
    if rec.phase == STEP:
        return STEP, step_budget(rec, b)
    return rec.phase, float("inf")  # done: the script is finishing; torchrun's exit decides


@dataclass(frozen=True)
class Hang:
    """What the launcher found: the ranks over their budget, and every local rank's last state."""

    ranks: tuple[int, ...]  # the suspects: of the ranks over budget and the ranks behind them, those at
    # the lowest step (the others passed it and wait for them in a collective)
    phase: str  # the phase of the first of them
    step: int  # the lowest last step among them (-1: before any step)
    silent_s: float  # how long the first of them had been silent
    budget_s: float
    last_heartbeat: float  # time.monotonic() of that rank's last heartbeat
    ranks_state: dict[int, dict[str, Any]]  # rank -> {step, phase, age_s} (unknown ranks: step, age None)
    over: tuple[int, ...] = ()  # every rank over its budget at the verdict

    @property
    def key(self) -> tuple[tuple[int, ...], int]:
        """Two hangs are 'the same' when the same ranks stop at the same step."""
        return self.ranks, self.step


def judge(records: dict[int, Record | None], now: float, b: HangBudgets, save_cost_s: float = 0.0,
          unwatched: frozenset[int] = frozenset(), io_at: float | None = None) -> Hang | None:
    """`records`: this node's ranks (None: no record, "unknown"); `unwatched`: ranks whose writes
    failed. Both are shown in the state and never judged. `now`: time.monotonic(). `io_at`: when
    the bytes of a save in progress last moved: a rank saving or restoring is silent only since
    then (a save whose files visibly grow is alive)."""
    if not b.enabled:
        return None
    every: list[tuple[float, int, str, float, float]] = []
    state: dict[int, dict[str, Any]] = {}
    peer_io_s = restoring_io_s(records, b)
    for rank, rec in sorted(records.items()):
        if rec is None or rank in unwatched:
            state[rank] = {"step": None, "phase": UNWATCHED if rank in unwatched else UNKNOWN, "age_s": None}
            continue
        phase, allowed = budget(rec, b, save_cost_s, peer_io_s)
        last = max(rec.time, io_at) if io_at is not None and phase in (SAVE, RESTORE) else rec.time
        silent = now - last
        state[rank] = {"step": rec.step, "phase": phase, "age_s": round(silent, 3)}
        every.append((last, rank, phase, silent, allowed))
    over = sorted(o for o in every if o[3] > o[4])
    if not over:
        return None
    silent_ranks = tuple(sorted(r for _, r, _, _, _ in over))
    # The suspects: the ranks at the lowest step among those over budget and those behind them (a
    # rank that stops before its next step() leaves the others a step ahead, waiting in a
    # collective; budgets differ per rank, so a waiting rank may cross its budget first). A rank
    # still in start-up is never "behind": the others cannot have passed a collective without it.
    judged = {r for _, r, _, _, _ in every}
    ahead = min(state[r]["step"] for r in silent_ranks)
    behind = {r for r in judged if state[r]["phase"] != STARTUP and state[r]["step"] < ahead}
    candidates = set(silent_ranks) | behind
    step = min(state[r]["step"] for r in candidates)
    suspects = tuple(r for r in sorted(candidates) if state[r]["step"] == step)
    last, _, phase, silent, allowed = min(o for o in every if o[1] in suspects)
    return Hang(suspects, phase, step, round(silent, 3), round(allowed, 3), last, state, silent_ranks)


def percentile(values: list[float] | tuple[float, ...], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def stragglers(medians: dict[int, float], samples: dict[int, int]) -> list[int]:
    """Ranks whose median step time exceeds the median of the other ranks' medians by more than
    STRAGGLER_MARGIN (each with at least STRAGGLER_MIN_SAMPLES steps measured)."""
    known = {r: m for r, m in medians.items() if samples.get(r, 0) >= STRAGGLER_MIN_SAMPLES and m > 0}
    if len(known) < 2:
        return []
    out = []
    for rank, med in sorted(known.items()):
        others = statistics.median(m for r, m in known.items() if r != rank)
        if med > (1 + STRAGGLER_MARGIN) * others:
            out.append(rank)
    return out


def failsave_victims(hang: Hang, guarded: set[int]) -> tuple[int, ...]:
    """Pure: the ranks to SIGKILL first so that the others make the failure-time save of their last
    boundary before the run is killed (issue 47, item 3), or () when no failure save can follow
    (a rank of this node without the failure guard: several nodes, an old library). The suspects
    go (the ranks past them only wait for them); when every rank is a suspect (the stuck one and
    those waiting for it in a collective all stop at one step), only the highest goes: any rank
    still alive whose failure-save thread can run takes part, and its tensors are at that step."""
    ranks = set(hang.ranks_state) | set(hang.ranks)
    if not hang.ranks or not ranks <= guarded:
        return ()
    if set(hang.ranks) == ranks:
        return (max(hang.ranks),)
    return tuple(sorted(hang.ranks))

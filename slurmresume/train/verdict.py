"""The step-boundary verdict: at each `Checkpointer.step()`, what every rank does now.

Inputs: this rank's warning-signal flag (`signals.SignalFlag`), a drill's injected warning, and
rank 0's clock (a time-based save is decided by rank 0 alone, so ranks never disagree on it).
They travel in one integer, `signal * 2 + time_due`, through the pipelined MAX all-reduce
(`checkpoint.collective.LaggedMax`): every rank reads the same reduction, hence the same
`Verdict`, at the same step. `judge` is the pure part; `StepBoundary` the small shell around it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from ..checkpoint.collective import Group, LaggedMax
from ..contract import ENV_DRILL_FIRST_SAVE, ENV_LAUNCHER_PID, ENV_RESTART, EXIT_SAVE_FAILED
from .signals import (
    EXIT_PREEMPTED,
    EXIT_TERMINATED,
    NONE,
    PREEMPT,
    SignalFlag,
    warning_signal_from_env,
)

log = logging.getLogger("slurmresume")

DRILL_RELAY_WAIT_S = 30.0  # how long a drill rank waits for the launcher to relay its warning
PERIODIC_TRIGGERS = ("steps", "epoch")  # SaveScheduler.trigger values every rank computes alike


@dataclass(frozen=True)
class Verdict:
    """What every rank does at this step boundary. `signal` (PREEMPT / TERMINATE): the emergency
    save of this step, then exit; else `save` ("steps", "epoch", "seconds"): a periodic save and
    why; else nothing."""

    signal: int = NONE
    save: str | None = None

    @property
    def emergency(self) -> bool:
        return self.signal != NONE


def encode(signal: int, time_due: bool) -> int:
    """This rank's contribution to the MAX: the signal wins over a time-based save."""
    return signal * 2 + int(time_due)


def judge(agreed: int, trigger: str | None, world_size: int) -> Verdict:
    """Pure. `agreed`: the MAX of every rank's `encode`; `trigger`: this rank's save policy
    (`SaveScheduler.trigger`). Steps and epochs are the same on every rank; "seconds" follows
    rank 0's clock, so with several ranks it counts only once it came back through the MAX."""
    signal, time_due = divmod(agreed, 2)
    if signal != NONE:
        return Verdict(signal=signal)
    if trigger in PERIODIC_TRIGGERS or time_due or (trigger == "seconds" and world_size == 1):
        return Verdict(save=trigger or "seconds")
    return Verdict()


def exit_code(signal: int, failed: bool, under_launcher: bool, recorded: bool) -> int:
    """Pure. What a rank exits with after the emergency save of an agreed `signal`: a failed save
    says so; under our launcher with the outcome record written, 0 (the record says what happened,
    and torchrun must not report a failure and kill peers); else (run bare, or no record) the
    signal's distinct code."""
    if failed:
        return EXIT_SAVE_FAILED
    if under_launcher and recorded:
        return 0
    return EXIT_PREEMPTED if signal == PREEMPT else EXIT_TERMINATED


class StepBoundary:
    """The per-step agreement of one rank. Collective: every rank calls `decide` once per step
    and `drain` at the end (LaggedMax's contract)."""

    def __init__(self, group: Group, flag: SignalFlag | None, drill_at: int | None) -> None:
        self.group = group
        self.flag = flag
        self.drill_at = drill_at  # rank 0 injects the warning at this step (`slurmresume drill`)
        self._agreement = LaggedMax(group)
        # rank 0 posted "time due" and it has not come back yet: post it once, not every step
        self._time_due_posted = False

    def decide(self, step: int, trigger: str | None) -> Verdict:
        if self.drill_at is not None and self.group.rank == 0 and step >= self.drill_at:
            self.drill_at = None
            inject_drill_signal(step, self.flag)
        local = self.flag.request if self.flag is not None else NONE
        time_due = trigger == "seconds" and self.group.rank == 0 and not self._time_due_posted
        if time_due and self.group.world_size > 1:
            self._time_due_posted = True
        agreed = self._agreement.exchange(encode(local, time_due))
        if agreed % 2:
            # rank 0's posted "time due" came back: it may post again, whatever this save's fate
            # (a failed save must not stop time-based saves for the rest of the run)
            self._time_due_posted = False
        return judge(agreed, trigger, self.group.world_size)

    def saved(self) -> None:
        """A save committed: a time-based save may be posted again."""
        self._time_due_posted = False

    def restored(self, step: int) -> None:
        """A resumed run: its drill warning comes after the restored step."""
        if self.drill_at is not None:
            self.drill_at = max(self.drill_at, step + 1)

    def drain(self) -> None:
        self._agreement.drain()


def drill_step_from_env() -> int | None:
    """`slurmresume drill`: the step at which this run (restart k) injects its warning, from
    $SLURMRESUME_DRILL_AT="12,30,41" (entry k for restart k)."""
    planned = [int(x) for x in os.environ.get("SLURMRESUME_DRILL_AT", "").split(",") if x.strip().isdigit()]
    k = int(os.environ.get("SLURMRESUME_RESTART_COUNT") or 0)
    return planned[k] if k < len(planned) else None


def drill_first_save_from_env() -> bool:
    """`slurmresume drill`: both runs save their first step (not a resumed run's), so that what
    differs between them before any warning (an RNG stream the script never seeds) is not blamed
    on the resume."""
    return os.environ.get(ENV_DRILL_FIRST_SAVE) == "1" and not int(os.environ.get(ENV_RESTART) or 0)


def inject_drill_signal(step: int, flag: SignalFlag | None) -> None:
    """Rank 0, `slurmresume drill`: send the warning signal to the launcher (as Slurm would),
    which relays it to every worker; the save lands at whichever step the ranks then agree on."""
    target = int(os.environ.get(ENV_LAUNCHER_PID) or os.getpid())
    log.info("drill: warning signal at step %d to pid %d", step, target)
    os.kill(target, warning_signal_from_env())
    # The launcher relays on its own clock (every 0.1 s); a fast script could finish its last
    # steps before the relay lands, and the drill would prove nothing. Hold this rank until the
    # warning has reached it (other ranks learn of it through the agreement).
    deadline = time.monotonic() + DRILL_RELAY_WAIT_S
    while flag is not None and flag.request == NONE and time.monotonic() < deadline:
        time.sleep(0.005)
    if flag is not None and flag.request == NONE:
        log.warning("drill: the warning signal did not reach rank 0 within %.0f s", DRILL_RELAY_WAIT_S)

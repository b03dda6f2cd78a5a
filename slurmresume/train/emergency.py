"""The emergency sequence: what every rank does once the step-boundary verdict (`verdict.py`)
says a warning signal (or SIGTERM) arrived. In order:

  1. rank 0: a `signal_agreed` event;
  2. all: wait for an async save in flight (its failure is logged: this save is what matters);
  3. rank 0: a provisional outcome record (`contract.write_outcome`): a crash during the save
     still tells the launcher which step was agreed;
  4. all: a synchronous save of the agreed step (`Checkpointer.save`, hence `saving.save_collective`),
     unless that very step is already committed;
  5. rank 0: `exit_after_save`, or `emergency_save_failed` when the step has no marker, and the
     final outcome record (committed only when the step has its marker);
  6. all: exit with `verdict.exit_code` (`exit_now`), or return to the script.

`save_and_exit` runs all six; `emergency_save` steps 1-5.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn, Protocol

from ..checkpoint.layout import MARKER, step_dir_name
from ..contract import (
    ENV_LAUNCHER_PID,
    ENV_RUN_ID,
    Outcome,
    write_outcome,
)
from ..errors import CheckpointError, SaveError
from ..events import (
    EV_EMERGENCY_SAVE_FAILED,
    EV_EXIT_AFTER_SAVE,
    EV_SIGNAL_AGREED,
    try_append_event,
)
from .signals import NONE, PREEMPT, SignalFlag
from .verdict import exit_code

log = logging.getLogger("slurmresume")


class Saver(Protocol):
    """What the sequence needs of a `Checkpointer`."""

    root: Path
    last_saved_step: int | None
    exit_on_signal: bool
    flag: SignalFlag | None
    mirror: Any

    @property
    def rank(self) -> int: ...

    def wait(self) -> None: ...

    def save(self, step: int, state: Mapping[str, Any], *, metrics: Any = ..., meta: Any = ...,
             reason: str = ...) -> Path | None: ...

    def close(self) -> None: ...


def save_and_exit(ckpt: Saver, step: int, state: Mapping[str, Any], signal: int, metrics: Any, meta: Any) -> bool:
    """Every rank, on an emergency verdict (`Checkpointer.step`): save the agreed step
    (`emergency_save`), then close and exit with `verdict.exit_code` (a failed save exits
    EXIT_SAVE_FAILED; the launcher then resumes from the newest complete checkpoint). With
    `exit_on_signal=False`: return True with the flag cleared, or raise SaveError if the save
    failed."""
    error, recorded = emergency_save(ckpt, step, state, "preempt" if signal == PREEMPT else "terminate",
                                     metrics, meta)
    if not ckpt.exit_on_signal:
        if error:
            raise SaveError(f"the emergency save of step {step} failed: {error}")
        if ckpt.flag is not None:
            ckpt.flag.request = NONE
        return True
    ckpt.mirror = None  # exit now: this step's upload is finished by the next run (Mirror.start)
    try:
        ckpt.close()
    except Exception as exc:  # noqa: BLE001 - exiting anyway; the record says what happened
        log.warning("close after the emergency save failed: %s", exc)
    exit_now(exit_code(signal, bool(error), bool(os.environ.get(ENV_LAUNCHER_PID)), recorded))


def emergency_save(ckpt: Saver, step: int, state: Mapping[str, Any], kind: str, metrics: Any,
                   meta: Any) -> tuple[str, bool]:
    """Every rank, steps 1-5 above. Returns (the error, or "" when `step` is committed; whether
    rank 0 wrote the outcome record — always True on the other ranks)."""
    run_id = os.environ.get(ENV_RUN_ID)
    if ckpt.rank == 0:
        log.warning("warning signal received (%s): saving step %d, then exiting", kind, step)
        try_append_event(ckpt.root, EV_SIGNAL_AGREED, step=step, kind=kind, run_id=run_id)
    try:
        ckpt.wait()
    except SaveError as exc:
        log.warning("in-flight async save failed: %s", exc)
    if ckpt.rank == 0:
        record_outcome(ckpt.root, Outcome(run_id or "", kind, step, False, "the emergency save did not finish"))
    error = ""
    try:
        if step != ckpt.last_saved_step:
            ckpt.save(step, state, metrics=metrics, meta=meta, reason=kind)
    except (SaveError, CheckpointError, OSError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    if ckpt.rank != 0:
        return error, True
    if not error and (ckpt.root / step_dir_name(step) / MARKER).exists():
        try_append_event(ckpt.root, EV_EXIT_AFTER_SAVE, step=step, kind=kind, run_id=run_id)
    else:
        error = error or f"step {step} has no commit marker"
        try_append_event(ckpt.root, EV_EMERGENCY_SAVE_FAILED, step=step, kind=kind, run_id=run_id, error=error)
    return error, record_outcome(ckpt.root, Outcome(run_id or "", kind, step, not error, error))


def record_outcome(root: Path, outcome: Outcome) -> bool:
    """Rank 0. False when there is no run id (run bare) or the record could not be written."""
    if not outcome.run_id:
        return False
    try:
        write_outcome(root, outcome)
        return True
    except (OSError, ValueError) as exc:
        log.warning("could not write the outcome record of run %s under %s: %s", outcome.run_id, root, exc)
        return False


def exit_now(code: int) -> NoReturn:
    """Leave at once (no atexit, no interpreter teardown that could hang on a process group),
    with the logs and the standard streams flushed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

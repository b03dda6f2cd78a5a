"""Replacing a committed step, crash-safe with or without renameat2(RENAME_EXCHANGE); and
`finish`, which settles a replace that a kill interrupted.

A replace is a final save whose state changed since a periodic save of the same step
(`Checkpointer.save`). `commit._swap_in` runs on rank 0, under the root lock, once the save's own
`.saving.step_N.<T>/` ("staged") is committed (manifest and marker durable, `.inprogress` note
gone). As for any save, the commit point is ONE rename:

  with RENAME_EXCHANGE (local file systems):
    1. exchange staged <-> step_N               the commit point: step_N is the new copy, the
                                                staged name holds the old one
    2. fsync the root; hide the old copy (`.deleting.*`) and remove it
  without it (NFS, Lustre, GPFS: `fsio.exchange` says so):
    1. rename step_N -> .replaced.step_N.<T>   the old copy parked (same token as the save) under
                                                a name that no clean-up knows (not `.deleting.*`,
                                                not `.saving.*`): nothing can delete it here
    2. rename staged -> step_N                 the commit point
    3. fsync the root; hide the parked copy and remove it

A kill leaves at most a parked copy and a second committed copy of step N under `.saving.` (no
note): between 1 and 2 step_N is absent, and the next run would resume an older step. `finish`
(the root's owner, at start, before its restore) rolls back what did not reach the commit point
and keeps what did, so the next run always finds step_N, complete, old or new copy:

  - a `.replaced.step_N.<T>` and no step_N: the parked copy takes its name back;
  - then every second copy of a step whose step_N is complete -- a parked `.replaced.step_N.*`, or
    a committed `.saving.step_N.*` whose note is gone (a replace killed before its commit point,
    the old copy after an exchange, or any save killed between its note's removal and its
    publishing rename, once the step was saved again) -- is hidden and removed. A step_N that
    is not complete keeps every copy beside it, untouched.

Why a note-less committed `.saving.*` may go: its writer removed the note (under the root lock
when it could take it) right before publishing, so it was past its last step; `finish` runs in
the root's owner before any save of its own, and the lease rules out another writer. Its step
stays complete either way.

Roll back, not forward: the commit point stays one rename in both modes (the exchange, or the
rename of step 2, whose failure already puts the old copy back), so a replace either happened or
did not, as the caller that was never told "saved" must assume. Every decision of `finish` is one
rename or the removal of a copy that duplicates a complete step, and none needs the staged copy
judged; a roll forward would need a separate intent record and, after an exchange, could not tell
the old copy from the new by name.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from filelock import Timeout

from . import fsio
from .commit import hide, root_lock
from .layout import INPROGRESS, MARKER, parse_replaced_dir, parse_saving_dir, step_dir_name

log = logging.getLogger("slurmresume")

FINISH_LOCK_TIMEOUT = 2.0  # a busy lock: the next start settles it (nothing is lost meanwhile)


def finish(root: Path, lock_timeout: float = FINISH_LOCK_TIMEOUT) -> list[str]:
    """Rank 0 of the run that owns `root` (its lease held), before it restores or saves: settle the
    replaces a kill interrupted (module docstring). Returns one sentence per action; never raises
    (a failure is logged, and the next start tries again)."""
    root = Path(root)
    parked, second = _candidates(root)
    if not parked and not second:
        return []
    done: list[str] = []  # a step back under its name: a warning
    removed: list[str] = []  # a second copy gone: nothing changed for a reader
    hidden: list[Path] = []
    try:
        with root_lock(root, lock_timeout):
            for name in parked:
                final = root / step_dir_name(_step_of(name))
                if not os.path.lexists(final):
                    fsio.rename(root / name, final, "replace.restore")
                    fsio.fsync_dir(root, "root")
                    done.append(f"{final} is back: a kill interrupted its replacement before the new copy took "
                                f"the name (the old copy was parked as {name})")
            parked, second = _candidates(root)  # again: what the renames left
            for name in parked + second:
                step = _step_of(name)
                if _complete(root / step_dir_name(step), step):
                    hidden.append(hide(root / name, "replaced"))
                    removed.append(f"removed {root / name}: a second copy of the complete {step_dir_name(step)} "
                                   "that a killed save or replace left")
    except Timeout:
        log.warning("the root lock of %s is busy: an interrupted replace there is settled at the next start", root)
    except OSError as exc:
        log.warning("could not settle an interrupted replace under %s: %s", root, exc)
    for path in hidden:
        shutil.rmtree(path, ignore_errors=True)
    for line in done:
        log.warning("%s", line)
    for line in removed:
        log.info("%s", line)
    return done + removed


def pending(root: Path) -> list[str]:
    """For `status` (read-only): one sentence per parked old copy still in `root`."""
    out = []
    for name in _candidates(Path(root))[0]:
        final = step_dir_name(_step_of(name))
        state = "holds the new copy" if os.path.lexists(Path(root) / final) else "is absent meanwhile"
        out.append(f"{name} is the old copy of {final}, whose replacement a kill interrupted ({final} {state}): "
                   f"the run that owns the root settles it when it starts (the old copy back, or dropped)")
    return out


def _candidates(root: Path) -> tuple[list[str], list[str]]:
    """(parked old copies, committed `.saving.*` copies whose note is gone) under root."""
    try:
        names = os.listdir(root)
    except OSError:
        return [], []
    parked = sorted(n for n in names if parse_replaced_dir(n) is not None)
    second = sorted(n for n in names if parse_saving_dir(n) is not None and os.path.lexists(root / n / MARKER)
                    and not os.path.lexists(root / n / INPROGRESS))
    return parked, second


def _step_of(name: str) -> int:
    step = parse_replaced_dir(name)
    step = parse_saving_dir(name) if step is None else step
    if step is None:
        raise ValueError(f"{name!r} is neither a parked copy nor a save directory")
    return step


def _complete(path: Path, step: int) -> bool:
    from .store import inspect_dir

    return inspect_dir(step, path).complete

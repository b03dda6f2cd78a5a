"""The health verdict of a status snapshot: the problems and warnings its facts add up to
(the headline itself is health.judge)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from ..checkpoint.layout import LOCK
from ..checkpoint.store import UNREADABLE
from ..events import EV_FAILED, EV_GAVE_UP, EV_SAVE_COMMITTED, EV_SAVE_FAILED
from ..job.leadtime import late_warning, lead_warning
from .health import mirror_behind, mirror_warning
from .status_model import Status

_BAD_STATES = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def judge_health(status: Status, root: Path, events: list[dict[str, Any]]) -> None:
    """Fill problems and warnings: the verdict of `health`."""
    p, w = status.problems, status.warnings
    last = events[-1]["event"] if events else None
    if last in (EV_FAILED, EV_GAVE_UP):
        p.append(f"the last event is {last!r}: the run stopped (see the history)")
    if status.job.state and status.job.state.split()[0] in _BAD_STATES:
        p.append(f"Slurm reports job {status.job.job_id} as {status.job.state}")
    for row in status.checkpoints:
        if row.state == "corrupt" or row.verified is False:
            p.append(f"checkpoint {row.path} is corrupt: {row.problem}")
    lag = mirror_behind(events)
    if lag:
        p.append(lag)
    elif warning := mirror_warning(events):
        w.append(warning)
    if status.newest_complete is None:
        w.append(f"no complete checkpoint under {root} yet")
    for row in status.checkpoints:
        if row.state != "unreadable":
            continue
        # by this version or this user: restore refuses it rather than resume an older step
        blocks = not any(r.state == "complete" and r.step > row.step for r in status.checkpoints)
        if (row.problem or "").startswith(UNREADABLE):
            (p if blocks else w).append(f"{row.name} is {row.problem}; "
                                        + ("restore refuses it (no resume) until it can be read" if blocks else "skipped"))
        else:
            (p if blocks else w).append(f"{row.name}: {row.problem}"
                                        + ("; restore refuses it (no resume) until then" if blocks else ""))
    leftovers = [r.name for r in status.checkpoints if r.state == "incomplete"]
    if leftovers:
        w.append(f"{len(leftovers)} incomplete director{'y' if len(leftovers) == 1 else 'ies'} "
                 f"({', '.join(leftovers[:3])}{', ...' if len(leftovers) > 3 else ''}): "
                 "`slurmresume prune --remove-incomplete-older-than 1d` removes old ones")
    saves = [e for e in events if e["event"] in (EV_SAVE_COMMITTED, EV_SAVE_FAILED)]
    if saves and saves[-1]["event"] == EV_SAVE_FAILED:
        w.append(f"the last save failed: {saves[-1].get('error')}")
    if status.lead is not None:
        w.extend(late_warning(late) for late in status.lead.late)
        short = lead_warning(status.lead)
        if short:
            w.append(short)
    w.extend(root_warnings(root))
    w.extend(leftover_warnings(root))


def root_warnings(root: Path) -> list[str]:
    """Permission problems that let other users plant or delete checkpoints."""
    out = []
    mode = stat.S_IMODE(os.stat(root).st_mode)
    if mode & stat.S_IWOTH:
        out.append(f"checkpoint root {root} is world-writable (mode {mode:o}): any user here can plant "
                   f"or delete checkpoints; run `chmod o-w {root}`")
    try:
        if not stat.S_ISREG(os.lstat(root / LOCK).st_mode):
            out.append(f"lock file {root / LOCK} is a link or not a regular file: remove it")
    except FileNotFoundError:
        pass
    return out


def leftover_warnings(root: Path) -> list[str]:
    """Save and mirror-download directories still in the root (running, or left by a killed
    writer that cannot be proven dead from here), with their size; old copies a killed replace
    parked."""
    from ..checkpoint.leftovers import listing
    from ..checkpoint.replace import pending

    return pending(root) + [f"{name} holds {size / 2**20:.1f} MiB: a save or mirror download that is running or was killed; "
            "the root's owner removes it at its next save (or `prune`) once its writer is provably dead and "
            "it is idle for 10 min" for name, size in listing(root)]

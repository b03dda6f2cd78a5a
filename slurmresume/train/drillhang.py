"""`slurmresume drill --hang` on the rank's side: which rank stops making progress, at which step
of which attempt (`drill_hang_step`, from the drill's plan in $SLURMRESUME_DRILL_HANG), and the
injected hang itself (`drill_hang_here`: its frame is what the hung rank's stack dump shows, and
what tools/drill.py looks for in it).
"""

from __future__ import annotations

import os
import time

from ..contract import ENV_DRILL_HANG, ENV_RUN_ID


def drill_hang_step(rank: int) -> int | None:
    """`slurmresume drill --hang`: the step at which this rank stops making progress in this
    attempt, from $SLURMRESUME_DRILL_HANG="1:12,0:30" (entry k: rank:step for attempt k of the
    run id "<job>.<restart>.<attempt>"); None for every other rank and attempt."""
    planned = os.environ.get(ENV_DRILL_HANG, "").split(",")
    try:
        attempt = int(os.environ.get(ENV_RUN_ID, "").rsplit(".", 1)[1])
    except (IndexError, ValueError):
        return None
    if attempt >= len(planned):
        return None
    who, _, at = planned[attempt].partition(":")
    return int(at) if who.strip().isdigit() and at.strip().isdigit() and int(who) == rank else None


def drill_hang_here(step: int) -> None:
    """The injected hang: this rank stops before the step's collective and never returns; the
    other ranks wait for it in theirs. The launcher must detect it, dump the stacks (this frame
    is what the hung rank's dump shows) and kill the run."""
    import logging

    logging.getLogger("slurmresume").warning("drill: rank hangs at step %d (pid %d)", step, os.getpid())
    while True:
        time.sleep(3600)

"""The collective verdict on one load of a restore: every rank's failure (or none) gathered by
rank 0, the first few broadcast, decisive ones first, so that every rank acts on the same error
(`restoreload` asks it after each read, `restoreapply` once more after the live state is written).
A rank's own exception becomes its part of the verdict here (`caught`), never raised on it alone.
"""

from __future__ import annotations

import logging
from typing import Any

from ..checkpoint.collective import Group
from .messages import DECISIVE, Failure
from .restoreplan import Loaded

log = logging.getLogger("slurmresume")
MAX_FAILURES = 4  # load errors every rank receives (the first is the one reported)


def verdict(group: Group, got: Loaded) -> tuple[list[Failure], list[list[int]]]:
    """Collective: the load errors (the verdict: rank 0 gathers each rank's fixed-size record and
    broadcasts the first few errors, decisive ones first, else in rank order) and, on rank 0
    only, [bytes read, bytes needed] per rank."""
    records = group.gather_json({"failure": got.failure and got.failure.to_json(), "io": [got.read, got.needed]})
    mine = first_failures([r["failure"] for r in records if r["failure"]]) if records is not None else None
    failures = group.broadcast_json(mine)
    return [Failure.from_json(f) for f in failures], [r["io"] for r in records] if records is not None else []


def first_failures(failures: list[dict[str, Any]], most: int = MAX_FAILURES) -> list[dict[str, Any]]:
    """Pure, rank 0: the failures every rank receives (in rank order): the decisive ones (a
    ConfigError, a bug: they end the restore) first, so that the one every rank raises is never
    cut off by a checkpoint problem of a lower rank; a rank's report that the rank reading a shard
    for it failed ("peer") last, after that rank's own error."""
    return sorted(failures, key=lambda f: (f["kind"] not in DECISIVE, f["kind"] == "peer"))[:most]


def caught(group: Group, exc: Exception, doing: str) -> Failure:
    """This rank's `exc`, raised while `doing`, as its part of the verdict; an unexpected one (a
    bug) is logged here with its traceback, the only rank that has it."""
    failure = Failure.on_rank(exc, group.rank, group.world_size, doing)
    if failure.kind == "bug":
        log.error("%s", failure.message, exc_info=exc)
    return failure

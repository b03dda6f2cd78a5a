"""Restore with fallback: the newest checkpoint that loads on every rank, as one collective call
(the loop over the steps tried, and its record). Its parts, each in its own module: rank 0's
choice of the step (`restorechoice`), loading one chosen step all or nothing (`restoreload`, over
one rank's plan and read, `restoreplan`, and the collective verdict, `restoreverdict`), applying
it to the live state (`restoreapply`).

Call order (`restore_collective`, every rank; "0" = rank 0 only; each arrow one collective):

  1. 0:   choose (`restorechoice.pick`): pull a newer step from the mirror (first round only), find the
          newest committed step not tried yet (or exactly `step`), check its shards when it
          predates per-block digests; or refuse a fresh start on a root that had progress
          -> broadcast RestoreChoice | Failure | None
  2. all: a Failure raises its exception on every rank; None is a fresh start (or, for an
          explicit `step`, an error); a world size the checkpoint cannot be loaded on raises.
  3. 0:   the bytes of the chosen manifest that it read and validated (`restoreload.share_manifest`)
          -> broadcast (length, then payload): no rank but 0 opens manifest.json
     all: plan and read this rank's part (`restoreplan.plan_part`, `restoreplan.read_part`) into
          staging memory, every byte checked against its recorded digest as it is read; nothing
          in `state` is touched
          -> gather the load errors (Failure | None), broadcast the first: the collective verdict.
          Whatever a rank's plan or read raises is its error here, never raised on it alone.
  4. all: no error anywhere: apply (`restoreapply.apply_loaded`: copy into the live tensors, load_state_dict)
          and return the choice; a ConfigError (the state does not fit) or an unexpected
          exception (a bug) on any rank: every rank raises it (ConfigError, RankFailedError),
          naming the rank, and no older step is tried; else (a checkpoint problem: rank 0 logs)
          fall back to the next older step from 1, unless `step` was explicit. A refused step
          leaves `state` bitwise as it was on every rank, so a fallback (or a caller that catches
          the error) starts from untouched objects.

Warm (every rank's shards in the page cache, same world size, no staging budget set): step 3
verifies without keeping and the copy into the live state is a second verified read, both from
memory (no staging memory to fault in); a file that changes between the two passes then leaves
the state half-loaded, with an error on every rank saying so.

Memory: the staging costs, on each rank, the bytes of the tensors that rank loads (its own
shard's tensors, the replicated ones, its box of each DTensor), in CPU memory, for the duration
of the restore; it is freed once copied into the live state. No rank holds a second rank's part.
Every rank but 0 receives the manifest's bytes (O(W + T): ~1.5 MiB at 16,384 ranks) once per step
tried and drops them once its plan has parsed them.

`restore_and_record` is what `Checkpointer.restore` calls: the above, then what was loaded
(`CheckpointInfo`) and its record (rank 0: the log line and the `restored` event).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..checkpoint.collective import Group
from ..checkpoint.layout import step_dir_name
from ..checkpoint.store import CheckpointInfo
from ..contract import ENV_RESTORE_STAGING, ENV_RUN_ID
from ..errors import CheckpointError, CorruptCheckpointError
from ..events import EV_RESTORED, process_started_at, try_append_event
from ..importtime import IMPORTED_AT
from .messages import Failure, RestoreChoice, pick_from_json, pick_to_json
from .restorechoice import pick
from .restoreload import Request, load_choice
from .restoreplan import staging_budget

log = logging.getLogger("slurmresume")


def restore_and_record(group: Group, root: Path, state: MutableMapping[str, Any], req: Request, mirror: Any, *,
                       created_at: float, memory: Path | None = None) -> CheckpointInfo | None:
    """Collective: from the memory tier's root `memory` first when it holds a step at least as
    new as the file tier's (`memrestore.from_memory`: one fallback at most, named), else
    `restore_collective` on `root`; then every rank inspects what it loaded (the returned
    `CheckpointInfo`, `Checkpointer.restored`) and rank 0 logs it and writes the `restored` event
    (its `tier`: memory or file, and a memory fallback's reason)
    with this rank's start-up breakdown: the process's start, the end of the script's imports
    (slurmresume imported), the Checkpointer's creation (`created_at`), the restore. None on a
    fresh start (logged once, by rank 0)."""
    started = time.perf_counter()
    restore_began = time.time()
    choice: RestoreChoice | None = None
    io: list[list[int]] = []
    fallback: str | None = None
    if memory is not None:
        from .memrestore import from_memory

        choice, io, fallback = from_memory(group, memory, root, state, req, restore_collective)
    tier = "memory" if choice is not None else "file"
    if choice is None:
        choice, io = restore_collective(group, root, state, req, mirror)
        if memory is not None:  # memory snapshots past this step: another trajectory's (each node's first rank)
            from .memtier import forget_from, node_leader

            if node_leader():
                forget_from(memory, choice.step + 1 if choice is not None else 0)
    if choice is None:
        if group.rank == 0:
            log.info("fresh start: no complete checkpoint under %s", root)
        return None
    # every rank parsed the manifest once, to plan its read: what it loaded is that, no file opened
    info = CheckpointInfo(choice.step, Path(choice.path), True, manifest=choice.manifest)
    if group.rank == 0:
        log.info("restored from step %d (%s) in %.2f s%s", choice.step, choice.path, time.perf_counter() - started,
                 " (memory tier)" if tier == "memory" else "")
        extra = {"tier": tier, "memory_fallback": fallback} if memory is not None else {}
        try_append_event(root, EV_RESTORED, step=choice.step, run_id=os.environ.get(ENV_RUN_ID), **extra,
                         process_started_at=process_started_at(), imported_at=IMPORTED_AT, created_at=created_at,
                         restore_began_at=restore_began, restore_s=round(time.time() - restore_began, 4),
                         **read_summary(io))
    return info


def read_summary(io: list[list[int]], per_rank_up_to: int = 256) -> dict[str, Any]:
    """The `restored` event's read figures from each rank's [bytes read, bytes needed] (tensor
    data only; headers are not counted): totals, the rank that read the most per byte it needed
    and that ratio, and the per-rank lists while the world is at most `per_rank_up_to` ranks
    (the event stays one short line at any scale)."""
    ratios = [r / n if n else 1.0 for r, n in io]
    worst = max(range(len(io)), key=ratios.__getitem__, default=0)
    out: dict[str, Any] = {"read_bytes_total": sum(r for r, _ in io), "needed_bytes_total": sum(n for _, n in io),
                           "read_ratio_max": round(ratios[worst], 4) if io else 1.0, "read_ratio_max_rank": worst}
    if len(io) <= per_rank_up_to:
        out["read_bytes"], out["needed_bytes"] = [r for r, _ in io], [n for _, n in io]
    return out


def restore_collective(group: Group, root: Path, state: MutableMapping[str, Any], req: Request,
                       mirror: Any = None) -> tuple[RestoreChoice | None, list[list[int]]]:
    """Collective (see the module docstring). Returns the checkpoint loaded into `state` (None on
    a fresh start; `choice.manifest` is this rank's parse of its manifest) and, per rank,
    [tensor data bytes read, bytes needed] for it. Raises the same
    error on every rank when nothing may be loaded."""
    tried: set[int] = set()
    budget = staging_budget(os.environ.get(ENV_RESTORE_STAGING), _mem_available(),
                            int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    while True:
        verify = req.verify or bool(tried)
        mine = pick(root, req.step, verify, tried, req.allow_fresh_start, mirror) if group.rank == 0 else None
        choice = pick_from_json(group.broadcast_json(pick_to_json(mine)))
        if isinstance(mine, RestoreChoice) and isinstance(choice, RestoreChoice):
            choice = mine  # rank 0 keeps its parse of the manifest (it never crosses ranks)
        elif req.own_root and isinstance(choice, RestoreChoice):
            choice = replace(choice, path=str(root / step_dir_name(choice.step)))
        if isinstance(choice, Failure):  # raised on every rank, same kind (rank 0: from its cause)
            raise choice.error() from (mine.cause if isinstance(mine, Failure) else None)
        if choice is None:
            if req.step is not None:
                raise CheckpointError(f"step {req.step} is not a complete checkpoint under {root}: "
                                      f"run `slurmresume status --ckpt-dir {root}` to list them")
            return None, []
        if choice.world_size != group.world_size and not choice.elastic:
            raise CheckpointError(
                f"checkpoint {choice.path} was written by {choice.world_size} ranks, this run has "
                f"{group.world_size}, and it holds per-rank (sharded) tensors: run with "
                f"--nodes/--nproc-per-node giving {choice.world_size} ranks")
        failures, io, manifest = load_choice(group, root, state, req, choice, budget)
        if not failures:
            return replace(choice, manifest=manifest), io
        if group.rank == 0:
            log.warning("checkpoint step %s (%s) unusable: %s; falling back to the previous one",
                        choice.step, choice.path, failures[0].message)
        if req.step is not None:
            raise CorruptCheckpointError(failures[0].message)
        tried.add(choice.step)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None

"""Restore from the memory tier first (train/memtier.py), as one collective call, else say why not.

Call order (`from_memory`, every rank; "0" = rank 0 only; each arrow one collective):

  0. all, several nodes only: each rank's node's committed memory steps with their marker's digest
          (`node_steps`)                                           -> gather to rank 0
  1. 0:   `memory_choice` (pure) over the memory root's newest committed step (several nodes: the
          newest that every node holds with rank 0's marker, `common_step`; its marker, then its
          manifest: `inspect_dir`) and the file tier's newest marker: the memory step when
          it is complete, written by this world size, at least as new as the file tier's newest,
          and no explicit step was asked for; else None and why   -> broadcast {step, why}
  2. all: none: return (the caller restores from the file tier; a problem with the memory
          step, as opposed to "older" or "none", is the one fallback, named)
  3. all: `restoring.restore_collective` of exactly that step from the memory root: the same
          plan, per-block verification and collective verdict as a file restore, so the live state
          is touched only once every rank's part verified (all or nothing); read in the two passes
          from memory (`Request.warm`: verify everything, then read into the live tensors), with no
          staging copy to fault in, through mappings of the files (`checkpoint.mapped`: the first
          pass hashes the pages where they lie, the second copies each byte once and hashes the
          block it landed in while it is in cache), since nothing writes this job's tmpfs. A refused
          step (a damaged byte, a missing shard) raises the same CheckpointError on every rank:
          caught here, the one fallback, named; rank 0 removes that memory step, so no later
          restart tries it again (never a loop; several nodes: each node's first rank removes its
          copy). Several nodes: every rank reads the step from its own node's root (`own_root`),
          where its shard is (train/memtier.py). A ConfigError (the state does not fit) or a bug
          is raised as from a file restore: the file tier would fail the same way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.layout import shard_name, step_dir_name
from ..checkpoint.mapped import reading_mapped
from ..checkpoint.store import inspect_dir, marker_digests, newest_committed, remove_private_step
from ..contract import ENV_RUN_ID
from ..errors import CheckpointError
from ..events import EV_MEMORY_FALLBACK, try_append_event
from .memtier import node_leader

if TYPE_CHECKING:
    from ..checkpoint.collective import Group
    from .messages import RestoreChoice

log = logging.getLogger("slurmresume")


def memory_choice(mem_step: int | None, mem_problem: str | None, mem_world: int | None, file_step: int | None,
                  world: int, asked: int | None) -> tuple[int | None, str]:
    """Pure, rank 0: (the memory step to restore, or None; why). A `why` starting "unusable" is a
    fallback to report; the others are the ordinary reasons the file tier is read."""
    if asked is not None:
        return None, f"step {asked} was asked for"
    if mem_step is None:
        return None, "no snapshot in memory"
    if file_step is not None and mem_step < file_step:
        return None, f"the file tier's step {file_step} is newer than the memory tier's {mem_step}"
    if mem_problem is not None:
        return None, f"unusable: memory snapshot of step {mem_step}: {mem_problem}"
    if mem_world != world:
        return None, f"the memory snapshot was written by {mem_world} ranks, this run has {world}"
    return mem_step, f"memory snapshot of step {mem_step}"


def from_memory(group: Group, memory: Path, root: Path, state: MutableMapping[str, Any], req: Any,
                restore_collective: Callable[..., tuple[RestoreChoice | None, list[list[int]]]],
                ) -> tuple[RestoreChoice | None, list[list[int]], str | None]:
    """Collective (see the module docstring). `req`: the restore's `restoreload.Request`;
    `restore_collective`: restoring's, handed in (this module is below it). Returns (the step
    loaded into `state` from memory, or None; per rank [bytes read, needed]; the fallback's
    reason, or None when there was none)."""
    spread = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1) < group.world_size
    held = group.gather_json(node_steps(memory, group.rank, group.world_size)) if spread else None
    mine = _choose(memory, root, group.world_size, req.step, held) if group.rank == 0 else None
    step, why = group.broadcast_json(mine)
    fallback = why if step is None and why.startswith("unusable") else None
    if step is None:
        if fallback:
            _fell_back(root, memory, None, why, group.rank == 0)
        return None, [], fallback
    try:
        with reading_mapped():  # its own tmpfs: both passes through mappings (checkpoint/mapped.py)
            choice, io = restore_collective(group, memory, state, replace(req, step=step, allow_fresh_start=True,
                                                                          warm=True, own_root=spread))
    except CheckpointError as exc:  # the same on every rank (the collective verdict): `state` untouched
        fallback = f"unusable: memory snapshot of step {step}: {exc}"
        _fell_back(root, memory, step, fallback, group.rank == 0)
        return None, [], fallback
    return choice, io, None


def node_steps(memory: Path, rank: int, world: int) -> list[list[Any]]:
    """Every rank, several nodes: its node's committed memory steps, each with its marker's digest
    and whether this rank's own shard is there ([[step, xxh3, mine], ...]; a node holds two at
    most). `mine` is false where the rendezvous put this rank on another node than the one that
    took the snapshot (c10d orders a node's agents by address and pid: on one host, by pid).
    Never raises: a root that cannot be read holds none."""
    return [[step, digest, os.path.lexists(memory / step_dir_name(step) / shard_name(rank, world))]
            for step, digest in marker_digests(memory).items()]


def common_step(held: list[Any]) -> int | None:
    """Pure, rank 0, `held` in rank order: the newest step that every rank's node holds with rank
    0's marker (the same manifest, so the same shards of one step on every node) and with that
    rank's own shard in it, or None (then the file tier is read: not a fallback)."""
    if not held or not all(isinstance(h, list) for h in held):
        return None
    common: set[tuple[int, str]] | None = None
    for entries in held:
        mine = {(int(e[0]), str(e[1])) for e in entries if isinstance(e, list) and len(e) == 3 and e[2] is True}
        common = mine if common is None else common & mine
    return max((s for s, _ in common or ()), default=None)


def _choose(memory: Path, root: Path, world: int, asked: int | None,
            held: list[Any] | None = None) -> tuple[int | None, str]:
    """Rank 0: `memory_choice` over what the two roots hold (markers; the memory step's manifest);
    several nodes (`held`, every rank's `node_steps`): the newest step every node holds with each
    rank's own shard on its node."""
    try:
        mem_step = newest_committed(memory) if held is None else common_step(held)
        problem = world_of = None
        if mem_step is not None and asked is None:
            info = inspect_dir(mem_step, memory / step_dir_name(mem_step), sizes=False)
            problem = None if info.complete else info.problem or "incomplete"
            world_of = info.manifest.world_size if info.manifest is not None else None
        return memory_choice(mem_step, problem, world_of, newest_committed(root), world, asked)
    except Exception as exc:  # noqa: BLE001 - the memory tier never stops a restore: the file tier is read
        return None, f"unusable: memory tier {memory}: {type(exc).__name__}: {exc}"


def _fell_back(root: Path, memory: Path, step: int | None, why: str, first: bool) -> None:
    """Every rank: the one fallback, in the log and the event log (rank 0, `first`); the step that
    failed is removed from memory by each node's first rank (a snapshot that failed its check is
    never tried again)."""
    if first:
        log.warning("memory tier: %s; restoring from the file tier (%s)", why.removeprefix("unusable: "), root)
        try_append_event(root, EV_MEMORY_FALLBACK, step=step, reason=why.removeprefix("unusable: "),
                         run_id=os.environ.get(ENV_RUN_ID))
    if not node_leader():
        return
    try:  # nothing may raise here (the other ranks are on to the file tier's collectives)
        step = newest_committed(memory) if step is None else step
    except OSError:
        return
    if step is not None:
        remove_private_step(memory / step_dir_name(step))

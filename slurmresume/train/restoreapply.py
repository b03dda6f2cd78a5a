"""Applying a loaded step to the live state (every rank, once every rank's part verified): the
values into `state` (`checkpoint.state.apply_entries`), a check that each object's load_state_dict
took them (`checkpoint.landed`, one more collective verdict), and the RNG states: restored, or
re-derived for a rank beyond the saved world.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from ..checkpoint.collective import Group
from ..checkpoint.landed import Landing
from ..checkpoint.state import apply_entries
from ..errors import ConfigError
from . import rng
from .messages import RestoreChoice
from .restoreplan import Loaded
from .restoreverdict import caught, verdict

log = logging.getLogger("slurmresume")


def _sampled(check: Any) -> Any:
    """`check()`, or None when it raises (a tensor type the sampling does not know): the check is
    skipped on this rank, with a warning, never a restore that fails or a rank that leaves the
    collective after it."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - an extra check must not take a restore down
        log.warning("could not check that the restored tensors were written (%s: %s)", type(exc).__name__, exc)
        return None


def apply_loaded(group: Group, state: MutableMapping[str, Any], got: Loaded, choice: RestoreChoice,
                 restore_rng: bool, exchanged: bool = False) -> None:
    """Every rank, once every rank has loaded and verified its part: the values into `state`
    (plain tensors copied in place where shape and dtype match), the RNG states."""
    assert got.decoded is not None  # only called when no rank failed
    landing = _sampled(lambda: Landing.before(state, got.decoded))
    apply_entries(state, got.decoded)
    # Collective: a load_state_dict that wrote nothing on any rank fails the restore on every rank
    # (never "restored"); a few sampled elements per tensor (checkpoint/landed.py)
    unchanged = _sampled(lambda: landing.unchanged(state, got.decoded)) if landing is not None else None
    failed = ConfigError(f"restoring step {choice.step}: {unchanged} by load_state_dict, though the checkpoint "
                         "holds other values: that object's load_state_dict did not load it, and the in-memory "
                         "state is not the checkpoint's; fix that object's load_state_dict") if unchanged else None
    failures, _ = verdict(group, Loaded(failure=caught(group, failed, "loading") if failed else None))
    if failures:
        raise failures[0].error()
    rank, saved_world = group.rank, choice.world_size
    if rank >= saved_world:
        # No saved RNG for this rank: re-derive it from the step and rank (documented rule),
        # rather than cloning another rank's stream.
        rng.reseed(choice.step, rank)
        log.warning("rank %d: checkpoint %s has %d ranks; this rank's RNG is re-seeded from step and rank "
                    "and its per-rank state comes from rank %d", rank, choice.path, saved_world, rank % saved_world)
    elif restore_rng and isinstance(got.library, dict) and "rng" in got.library:
        rng.restore(got.library["rng"])
    if saved_world != group.world_size and rank == 0:
        log.warning("resharded: checkpoint %s was written by %d ranks, restored on %d (replicated tensors "
                    "from rank 0's shard, %d DTensor(s) read by box%s)", choice.path, saved_world,
                    group.world_size, len(choice.manifest.sharded if choice.manifest else choice.sharded),
                    ", each saved shard opened by one rank and sent" if exchanged else "")

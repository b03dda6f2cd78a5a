"""Rank 0's choice of the step a restore loads: the newest committed step not tried yet (or
exactly the one asked for), pulled from the mirror first when it is newer there, its shards
checked whole when it predates per-block digests; or a refusal to start fresh on a root that had
progress. Never raises (`pick`: an error is its Failure, broadcast by `restoring`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from ..checkpoint.layout import MARKER, step_dirs
from ..checkpoint.sharding import to_json as sharding_json
from ..checkpoint.store import clean_temp_files, inspect_dir, unreadable_error
from ..contract import ENV_ALLOW_FRESH_START
from ..errors import CheckpointError, ConfigError, CorruptCheckpointError
from ..storage import DirRoot
from .messages import Failure, Pick, RestoreChoice

log = logging.getLogger("slurmresume")


def pick(root: Path, step: int | None, verify: bool, tried: set[int], allow_fresh: bool, mirror: Any) -> Pick:
    """Rank 0: what every rank loads next; never raises (an error is returned as a Failure)."""
    try:
        choice = choose(root, step, verify, tried, mirror)
        if choice is None and step is None and not allow_fresh:
            refusal = fresh_start_refusal(root, tried) or (mirror and mirror.fresh_start_refusal(root))
            if refusal:
                return Failure("checkpoint", refusal)
        if choice is not None:
            clean_temp_files(Path(choice.path), committed=True)  # its marker was just read
        return choice
    except (CheckpointError, ConfigError, OSError) as exc:
        return Failure.of(exc)
    except Exception as exc:  # noqa: BLE001 - a bug: raised on every rank, none left in the broadcast
        log.error("rank 0 failed while choosing the step to restore", exc_info=exc)
        return Failure.on_rank(exc, 0, 1, "choosing the step to restore")


def fresh_start_refusal(root: Path, tried: set[int]) -> str | None:
    """Rank 0, when nothing loads: a root that holds committed step directories had progress;
    starting over from step 0 there would silently throw it away (a transient read error, a
    damaged disk). Directories without a marker (a save killed before its commit) do not count."""
    committed = [(s, p) for s, p in step_dirs(root) if (p / MARKER).exists()]
    if not committed:
        return None
    newest, path = committed[0]
    why = "it failed to load (see the warning above)" if newest in tried else inspect_dir(newest, path).problem
    return (f"refusing a fresh start: {root} holds {len(committed)} committed step "
            f"director{'y' if len(committed) == 1 else 'ies'} but none loads (newest {path.name}: {why}); "
            f"run `slurmresume verify --all --ckpt-dir {root}`, or pass "
            f"restore(..., allow_fresh_start=True) (or set {ENV_ALLOW_FRESH_START}=1) to start from step 0")


def choose(root: Path, step: int | None, verify: bool, tried: set[int], mirror: Any = None) -> RestoreChoice | None:
    """Rank 0: the newest complete step not in `tried` (or exactly `step`); None when there is none."""
    if mirror is not None and not tried:  # a newer (or the only) step may be on the bucket
        mirror.pull(root, step)  # step=N: fetched from the bucket if only it has N
        mirror.start(root)  # and finish an upload a requeued run left
    elif mirror is not None and step is None and (again := mirror.refetch(root, tried)) is not None:
        tried = tried - {again}  # the damaged local copy was replaced by the bucket's verified one
    # Rank 0 checks no file's size here: each rank checks the size of every file it opens (its
    # shard, its index, the shards of its boxes) and the verdict is collective, so a truncated
    # file still makes the step fall back, without 2 W metadata operations on rank 0.
    store = DirRoot(root)
    if step is not None:
        info = store.inspect(step, verify=verify, sizes=False)
        if not info.complete:
            if info.unreadable:  # a newer release's step, another user's: refused, never called corrupt
                raise unreadable_error(info)
            if info.has_marker:
                raise CorruptCheckpointError(f"checkpoint {info.path}: {info.problem}")
            return None
    else:
        found = store.latest(verify=verify, exclude=tried, sizes=False, warn=True)
        if found is None:
            return None
        info = found
    if not verify and info.manifest is not None and not info.manifest.has_block_digests:
        # Written before per-block digests: no read can be checked as it happens, so check
        # the whole shards first (one extra read pass), and fall back like any corruption.
        info = store.inspect(info.step, verify=True)
        if not info.complete:
            if step is not None:
                raise CorruptCheckpointError(f"checkpoint {info.path}: {info.problem}")
            log.warning("skipping %s: %s", info.path, info.problem)
            return choose(root, step, verify, tried | {info.step})
    m = info.manifest
    if m is None:  # inspect_dir gives a manifest with every complete step
        raise CorruptCheckpointError(f"checkpoint {info.path}: no manifest")
    try:
        # The DTensor pieces cross ranks only when no rank can derive them from the manifest
        # (a mesh that does not span every rank: rank 0 read every index file for them).
        pieces = {} if m.placed_by_arithmetic else sharding_json(m.sharded)
        return RestoreChoice(info.step, str(info.path), m.world_size, m.digest, pieces, m.elastic, manifest=m)
    except CorruptCheckpointError as exc:  # format 2: a damaged tensor index, read only now
        if step is not None:
            raise
        log.warning("skipping %s: %s", info.path, exc)
        return choose(root, step, verify, tried | {info.step})

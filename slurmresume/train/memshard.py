"""A dead rank's pieces from its node's memory snapshot of exactly the failure save's step (issue 49).

FSDP2 keeps each piece on one rank only: when a rank dies, no survivor holds its pieces, and the
failure save (train/failsave.py) is refused. But every rank also wrote its shard of each snapshot
step into its node's memory root (train/memtier.py). A survivor on the dead rank's node (the
node's lowest, `FailureGuard._offer`) reads the dead rank's shard of the survivors' boundary step
from there, and offers it to the plan (`survivors.plan(memory=...)`) only on positive evidence:

- the same trajectory, the same step: the shard lies in the directory this survivor's own memory
  tier recorded for that step in this run (`Kept`: the private `.saving.` directory whose name rank
  0 broadcast for that one save, or this node's `step_N` once it carries that save's marker); never
  a directory found by its name alone (a previous incarnation's snapshot of the same step);
- complete: its shard and its tensor index under their final names (each is renamed into place
  only after it was written whole), a header that bounds-checks, the index's rank and file;
- verified: every byte of every tensor against the block digests computed over those bytes as they
  were written (the index's), and each dtype and shape against the index.

Anything else is a refusal (`Refused`, naming why): the failure save is refused as before and the
run restores from the memory or file tier. Never mixed steps: the offer names its step, and the plan
takes it only at that step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.bounded import read_bounded
from ..checkpoint.layout import MARKER, index_name, parse_saving_dir, shard_name, step_dir_name
from ..checkpoint.rankindex import MAX_INDEX, index_entries
from ..checkpoint.shard import TORCH_DTYPES, VERIFY_BLOCK
from ..checkpoint.shardread import byte_view, check_blocks, load_tensors
from ..errors import CheckpointError


@dataclass(frozen=True)
class Kept:
    """One rank's record of its memory snapshot of one step (train/memtier.py): the save's private
    directory `into`, and once committed, the marker rank 0 sent for it (`marker`; None: one node,
    where the commit renamed `into` itself)."""

    into: str
    committed: bool = False
    marker: bytes | None = None


class Refused(Exception):
    """No verified memory snapshot of the dead rank at that step (the message says why)."""


def locate(root: Path, step: int, kept: Kept | None) -> Path:
    """The directory on this node's memory root that holds this run's snapshot of `step` (see the
    module docstring). Raises Refused."""
    if kept is None:
        raise Refused(f"this node took no memory snapshot of step {step} in this run")
    if parse_saving_dir(kept.into) != step:
        raise Refused(f"{kept.into!r} is not a snapshot directory of step {step}")
    for _ in range(2):  # the node's first rank may rename it to step_N between the two looks
        if (root / kept.into).is_dir():
            return root / kept.into
        if kept.committed:
            done = root / step_dir_name(step)
            try:
                marker = (done / MARKER).read_bytes()
            except OSError:
                continue
            if kept.marker is None or marker == kept.marker:
                return done
            raise Refused(f"{done} is not this run's snapshot of step {step} (another marker)")
    raise Refused(f"no snapshot of step {step} of this run on this node's memory root {root}")


def load(directory: Path, rank: int, world: int) -> dict[str, Any]:
    """Every tensor of `rank`'s shard in `directory`, each byte checked against its index's block
    digests. Raises Refused."""
    file = shard_name(rank, world)
    path = directory / file
    if not os.path.lexists(path):  # renamed into place only once written whole: not landed yet
        raise Refused(f"rank {rank}'s shard of this snapshot is missing ({path}: it died before it landed)")
    try:
        index = directory / index_name(rank)
        entries = index_entries(read_bounded(index, MAX_INDEX, "tensor index"), rank, file, index)
        tensors, _, _ = load_tensors(directory, file, os.stat(path).st_size)
        if set(tensors) != set(entries):
            raise Refused(f"{path} and its index list different tensors")
        for name, t in tensors.items():
            info, digests = entries[name], entries[name]["xxh3"]
            if not (TORCH_DTYPES[str(info.get("dtype"))] == t.dtype and info.get("shape") == list(t.shape)):
                raise Refused(f"tensor {name!r} of {path} does not match its index")
            view = byte_view(t)
            if len(digests) != -(-len(view) // VERIFY_BLOCK):
                raise Refused(f"tensor {name!r} of {path}: its index records {len(digests)} checksum blocks")
            check_blocks(view, 0, digests, path, name)
    except (OSError, CheckpointError, KeyError, TypeError) as exc:
        raise Refused(f"rank {rank}'s memory shard {path}: {exc}") from None
    return tensors


def pieces(root: Path, step: int, kept: Kept | None, rank: int, world: int) -> dict[str, Any]:
    """`rank`'s verified tensors of `step` from this node's memory root. Raises Refused."""
    return load(locate(root, step, kept), rank, world)

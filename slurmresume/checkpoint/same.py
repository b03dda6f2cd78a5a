"""Is a state the same as the checkpoint already committed for its step? (One rank's view.)

Used by an explicit `Checkpointer.save(step, ...)` of a step a periodic save already committed:
the final save of a script that changed its state after that save (a final evaluation, a best
metric) must not be a silent no-op. Compared: this rank's JSON skeleton (plain values, the
structure, the library's RNG state) against its shard's header, and every tensor's bytes against
the per-block digests in the manifest. Metrics and meta are not state: they do not count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .jsonenc import dumps, loads
from .layout import shard_name
from .manifest import read_manifest
from .shard import SKELETON_KEY, block_digests
from .shardread import read_header
from .writer import tensor_bytes


def same_as_committed(step_dir: Path, step: int, rank: int, world_size: int, skeleton: dict[str, Any],
                      tensors: list[tuple[str, Any]]) -> bool:
    """True only when the committed checkpoint in `step_dir` holds exactly this rank's `skeleton`
    and `tensors` (False on any doubt: an older format, another world size, an unreadable file)."""
    try:
        manifest = read_manifest(step_dir, step)
        if manifest.world_size != world_size or not manifest.has_block_digests:
            return False
        shard = manifest.shards[rank]
        if shard["file"] != shard_name(rank, world_size):
            return False
        header, _ = read_header(step_dir, shard["file"], shard["bytes"])
        saved = loads(header["__metadata__"][SKELETON_KEY], "skeleton")
        shared = set(saved.pop("replicated", None) or ())
        if saved != loads(dumps(skeleton), "skeleton"):
            return False
        mine = manifest.rank_tensors(rank)
        first = manifest.rank_tensors(0) if shared else {}
        digests = {**{n: t.get("xxh3") for n, t in first.items() if n in shared},
                   **{n: t.get("xxh3") for n, t in mine.items()}}
        if set(digests) != {n for n, _ in tensors}:
            return False
        for name, t in tensors:
            cpu = t.detach()
            cpu = (cpu.cpu() if cpu.device.type != "cpu" else cpu).contiguous()
            if block_digests(tensor_bytes(cpu)) != digests[name]:
                return False
        return True
    except (CheckpointError, OSError, KeyError, TypeError, AttributeError):
        return False

"""Which tensors are replicated across ranks (data parallelism), so they are written once.

Each rank hashes its tensors (xxh3, ~20 GB/s here); a tensor whose name, dtype, shape and hash
agree on every rank is stored only in rank 0's shard, and the other ranks' skeletons list it as
replicated. No declaration is needed and nothing is guessed: a tensor that differs anywhere
(a sharded parameter, a per-rank RNG state) stays in each rank's own shard.
"""

from __future__ import annotations

from typing import Any

import xxhash

from .shard import st_dtype
from .writer import tensor_bytes

LIBRARY_PREFIX = "__slurmresume__/"


def tensor_digests(tensors: list[tuple[str, Any]], dtensors: dict[str, dict[str, Any]] | None = None) -> dict[str, list[Any]]:
    """Per name: dtype, shape, hash and, for a DTensor's local piece, its global offset: equal
    pieces at different offsets (a sharded LayerNorm weight of ones) are not replicas."""
    out: dict[str, list[Any]] = {}
    for name, t in tensors:
        cpu = t.detach()
        cpu = (cpu.cpu() if cpu.device.type != "cpu" else cpu).contiguous()
        out[name] = [st_dtype(cpu), list(cpu.shape), xxhash.xxh3_64_hexdigest(tensor_bytes(cpu))]
        if dtensors and name in dtensors:
            out[name].append(dtensors[name].get("offset"))
    return out


def replicated_names(per_rank: list[dict[str, list[Any]]]) -> set[str]:
    """Names present with identical (dtype, shape, hash) on every rank."""
    first, rest = per_rank[0], per_rank[1:]
    return {n for n, d in first.items() if all(r.get(n) == d for r in rest)}


def elastic(manifest_tensors: list[dict[str, Any]], world_size: int) -> bool:
    """A checkpoint can be loaded on another world size (or sharding) when every tensor is
    replicated, a DTensor piece with its global offset (read by box on restore), or the
    library's own per-rank state (RNG): only genuinely per-rank plain tensors pin the world."""
    return world_size == 1 or all(t.get("replicated") or "global_offset" in t
                                  or str(t.get("name", "")).startswith(LIBRARY_PREFIX)
                                  for t in manifest_tensors)

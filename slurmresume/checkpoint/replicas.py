"""Which tensors are replicated across ranks (data parallelism), so they are written once.

Each rank hashes its tensors (xxh3, ~20 GB/s here); a tensor whose name, dtype, shape and hash
agree on every rank is stored only in rank 0's shard, and the other ranks' skeletons list it as
replicated. No declaration is needed and nothing is guessed: a tensor that differs anywhere
(a sharded parameter, a per-rank RNG state) stays in each rank's own shard. A large tensor is
first compared by a sample of it (`sample_digest`): one that differs there is per-rank and is
not read whole before the write (issue #32: that pass was ~7% of a 2-rank save); only tensors
whose samples agree are hashed in full.
"""

from __future__ import annotations

import math
from typing import Any

import xxhash

from .jsonenc import dumps
from .shard import st_dtype
from .writer import tensor_bytes

LIBRARY_PREFIX = "__slurmresume__/"


SAMPLE_WHOLE = 1 << 20  # a tensor up to this size is sampled whole: its sample is its full hash
SAMPLES = 16  # else this many SAMPLE_BYTES slices, evenly spread, first and last included
SAMPLE_BYTES = 4096


def _host(t: Any) -> Any:
    cpu = t.detach()
    return (cpu.cpu() if cpu.device.type != "cpu" else cpu).contiguous()


def _device_sample(t: Any) -> memoryview:
    """The bytes `sample_digest` reads of a large device tensor, gathered on the device (the
    same bytes in the same order: its digest equals that of the host copy's sample)."""
    import torch

    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    last = flat.numel() - SAMPLE_BYTES
    parts = [flat[last * i // (SAMPLES - 1):][:SAMPLE_BYTES] for i in range(SAMPLES)]
    return tensor_bytes(torch.cat(parts).cpu())


def sample_digest(view: memoryview) -> str:
    """xxh3 of a few evenly spread slices of `view` (all of it when small): ranks whose samples
    differ certainly hold different bytes; equal samples prove nothing (`tensor_digests` decides)."""
    if len(view) <= SAMPLE_WHOLE:
        return xxhash.xxh3_64_hexdigest(view)
    h = xxhash.xxh3_64()
    last = len(view) - SAMPLE_BYTES
    for i in range(SAMPLES):
        at = last * i // (SAMPLES - 1)
        h.update(view[at : at + SAMPLE_BYTES])
    return h.hexdigest()


def tensor_digests(tensors: list[tuple[str, Any]], dtensors: dict[str, dict[str, Any]] | None = None,
                   sample: bool = False) -> dict[str, list[Any]]:
    """Per name: dtype, shape, hash and, for a DTensor's local piece, its global offset: equal
    pieces at different offsets (a sharded LayerNorm weight of ones) are not replicas. With
    `sample`, the hash is `sample_digest`'s (a tensor of at most SAMPLE_WHOLE bytes: its full hash)."""
    out: dict[str, list[Any]] = {}
    for name, t in tensors:
        if sample and t.device.type != "cpu" and _nbytes(t) > SAMPLE_WHOLE:
            digest = sample_digest(_device_sample(t))  # the slices only cross to the host
        else:
            view = tensor_bytes(_host(t))
            digest = sample_digest(view) if sample else xxhash.xxh3_64_hexdigest(view)
        out[name] = [st_dtype(t), list(t.shape), digest]
        if dtensors and name in dtensors:
            out[name].append(dtensors[name].get("offset"))
    return out


EVERYWHERE_BUDGET = 256 << 10  # replicated plain tensors up to this many bytes in all are in every shard


def everywhere(replicated: set[str], tensors: list[tuple[str, Any]], dtensors: dict[str, Any]) -> set[str]:
    """Pure, the same on every rank (a replica has the same size everywhere): the replicated
    plain tensors that every rank's shard holds too, not rank 0's alone, so that a restoring rank
    reads them from its own shard and opens no second one (issue #50: an optimizer's `step` per
    parameter and the RNG made every rank of a same-W restore open shard 0's header as well).
    All of them when they add up to at most EVERYWHERE_BUDGET, else none: a rank that must open
    shard 0 for one replica (a DDP model's weights) gains nothing from copies of the others.
    DTensors are read by box, never here. The format is unchanged: every reader of format 3
    reads a listed replica from its own shard when that holds it (`restoreplan`: shared = listed
    - own names), and rank 0's shard still holds every one."""
    plain = {n: _nbytes(t) for n, t in tensors if n in replicated and n not in dtensors}
    return set(plain) if sum(plain.values()) <= EVERYWHERE_BUDGET else set()


def by_placement(dtensors: dict[str, dict[str, Any]], world: int) -> tuple[set[str], set[str]]:
    """Pure: (replicated, sharded) DTensor names decided by their placements alone, for DTensors
    whose mesh spans every rank: identical on every rank when each of their Shard placements is
    on a mesh dimension of size 1, else pieces. A DTensor on a smaller mesh is in neither set
    (its value may differ between meshes: compared by digest like a plain tensor)."""
    replicated: set[str] = set()
    sharded: set[str] = set()
    for name, spec in dtensors.items():
        mesh = spec.get("mesh_shape") or []
        if math.prod(mesh) != world or len(mesh) != len(spec.get("placements") or ()):
            continue
        split = any(p != "replicate" and n > 1 for p, n in zip(spec["placements"], mesh))
        (sharded if split else replicated).add(name)
    return replicated, sharded


def replicated_across(group: Any, tensors: list[tuple[str, Any]],
                      dtensors: dict[str, dict[str, Any]] | None = None) -> set[str]:
    """Collective: the names stored once (rank 0's shard) because every rank holds the same
    bytes. DTensors spanning all ranks are decided by placement, with no exchange; the rest by
    fixed-size MAX reductions of 63-bit digests: the names and one digest per family of tensors
    (`_families`: the library's own, the rest) folded from each tensor's, in one reduction; only
    a family whose fold differs somewhere is compared tensor by tensor. A save of an FSDP2 + Adam
    state (a plain `step` tensor per parameter, identical everywhere) thus receives the same few
    dozen bytes at 7B and 405B, never 16 B per tensor (issue #50). Ranks whose tensor names
    differ fall back to exchanging the digests (`replicated_names`)."""
    dtensors = dtensors or {}
    placed, split = by_placement(dtensors, group.world_size)
    rest = [(n, t) for n, t in tensors if n not in placed and n not in split]
    sampled = tensor_digests(rest, dtensors, sample=True)
    keys = sorted(sampled)
    names = _h63(dumps([[k, *sampled[k][:2], *sampled[k][3:]] for k in keys]))
    head = [len(keys), names, *_folds(keys, sampled)]
    agreed = group.max_ints(head + [-v for v in head])
    if agreed[:2] != [-agreed[len(head)], -agreed[len(head) + 1]]:  # not the same names (and shapes) everywhere
        return placed | replicated_names(group.all_gather_json(tensor_digests(rest, dtensors)))
    # Samples first: a tensor whose samples differ on some rank is not a replica, and is never read
    # whole here (per-rank state: each rank's bytes are read once, by the writer). Only tensors
    # whose samples agree everywhere are hashed in full (every rank gets the same candidates).
    same = [agreed[2 + i] == -agreed[len(head) + 2 + i] for i in range(len(head) - 2)]
    candidates, by_name = _settle(group, keys, sampled, same), dict(rest)
    large = [k for k in keys if k in candidates and _nbytes(by_name[k]) > SAMPLE_WHOLE]
    full = tensor_digests([(k, by_name[k]) for k in large], dtensors)
    return placed | (candidates - set(large)) | _agreeing(group, large, full)


def _nbytes(t: Any) -> int:
    return int(t.numel() * t.element_size())


def _families(keys: list[str]) -> list[list[str]]:
    """Pure: `keys` split into the library's own tensors (its RNG: per-rank when a run seeds each
    rank apart) and the rest, each folded into one digest: a per-rank RNG state costs a
    comparison of the library's few tensors, not of every optimizer `step`."""
    return [[k for k in keys if k.startswith(LIBRARY_PREFIX)], [k for k in keys if not k.startswith(LIBRARY_PREFIX)]]


def _folds(keys: list[str], digests: dict[str, list[Any]]) -> list[int]:
    """One 63-bit digest per family (`_families`) of the names and digests of its tensors."""
    return [_h63(dumps([[k, digests[k][2]] for k in family])) for family in _families(keys)]


def _settle(group: Any, keys: list[str], digests: dict[str, list[Any]], same: list[bool]) -> set[str]:
    """Collective (every rank passes the same `keys` and `same`): the keys of the families whose
    folds agreed (`same`), and those of the other families whose own digest agrees everywhere."""
    agreed: set[str] = set()
    doubtful: list[str] = []
    for family, ok in zip(_families(keys), same):
        if ok:
            agreed.update(family)
        else:
            doubtful.extend(family)
    return agreed | _each_agreeing(group, doubtful, digests)


def _agreeing(group: Any, keys: list[str], digests: dict[str, list[Any]]) -> set[str]:
    """Collective (every rank passes the same `keys`): those whose digest is the same on every
    rank: one MAX reduction of the families' folds, then, for a family whose fold differs, two
    values per tensor (`_each_agreeing`); none when `keys` is empty."""
    if not keys:
        return set()
    folds = _folds(keys, digests)
    top = group.max_ints(folds + [-f for f in folds])
    return _settle(group, keys, digests, [top[i] == -top[len(folds) + i] for i in range(len(folds))])


def _each_agreeing(group: Any, keys: list[str], digests: dict[str, list[Any]]) -> set[str]:
    """Collective: `_agreeing`, tensor by tensor (two fixed-size MAX values each)."""
    if not keys:
        return set()
    values = [_h63(digests[k][2]) for k in keys]
    top = group.max_ints(values + [-v for v in values])
    return {k for i, k in enumerate(keys) if top[i] == -top[len(keys) + i]}


def _h63(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode()) & ((1 << 63) - 1)


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

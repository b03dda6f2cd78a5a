"""Which saved ranks hold a box of a DTensor, by arithmetic on its placements (format 2).

A DTensor saved from a mesh whose ranks are 0..W-1 in row-major order (`init_device_mesh` over
every rank) needs no per-rank list of pieces: rank r sits at coordinate unravel(r, mesh_shape),
and its piece follows from torch's rule for Shard placements: for each mesh dimension in order,
Shard(d) splits the current extent of dimension d into n chunks of ceil(extent / n) (the last
ones shorter, or empty). Along a Replicate mesh dimension every coordinate holds the same piece:
coordinate 0 (the lowest rank) is read. The restore reads that rank's shard, whose header and
index are checked against the piece computed here before a byte is used.
"""

from __future__ import annotations

import functools
import math
from typing import Any

Box = tuple[int, tuple[int, ...], tuple[int, ...]]  # (saved rank, global offset, shape)


def arithmetic(spec: Any, world: int) -> bool:
    """Whether a manifest's DTensor spec places its pieces by rank arithmetic alone."""
    mesh, placements = spec.get("mesh_shape"), spec.get("placements")
    return (spec.get("mesh_arange") is True and isinstance(mesh, list) and isinstance(placements, list)
            and len(mesh) == len(placements) and all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                                                     for n in mesh) and math.prod(mesh) == world)


def holders(shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[str, ...], offset: tuple[int, ...],
            box: tuple[int, ...]) -> tuple[Box, ...]:
    """Pure: the saved pieces (rank, global offset, shape) that intersect the box (offset, box),
    each held by the lowest rank that holds it. Work grows with the pieces found, not with W."""
    out = []
    for coords, lo, ext in pieces_at(shape, mesh, placements, offset, box):
        rank = 0
        for c, n in zip(coords, mesh):
            rank = rank * n + c
        out.append((rank, lo, ext))
    return tuple(out)


def pieces_at(shape: tuple[int, ...], mesh: tuple[int, ...], placements: tuple[str, ...], offset: tuple[int, ...],
              box: tuple[int, ...], every_replica: bool = False
              ) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Pure: (mesh coordinate, global offset, shape) of each non-empty piece that intersects the
    box (offset, box), by torch's rule. Along a Replicate mesh dimension: coordinate 0 only (the
    piece a reader takes), or, `every_replica`, every coordinate (the ranks that need the box:
    `exchange` finds a saved piece's readers so). Work grows with the pieces found, not with W."""
    states: list[tuple[tuple[int, ...], list[int], list[int]]] = [((), [0] * len(shape), list(shape))]
    for p, n in zip(placements, mesh):
        nxt: list[tuple[tuple[int, ...], list[int], list[int]]] = []
        for coords, lo, ext in states:
            if p == "replicate" or n == 1:
                nxt.extend(((*coords, c), lo, ext) for c in (range(n) if every_replica else (0,)))
                continue
            d = int(p[6:])
            chunk = -(-ext[d] // n)
            if chunk == 0:
                continue
            first = max(0, (offset[d] - lo[d]) // chunk)
            last = min(n - 1, (offset[d] + box[d] - 1 - lo[d]) // chunk)
            for c in range(first, last + 1):
                size = min(chunk, ext[d] - c * chunk)
                if size > 0:
                    nlo, next_ext = list(lo), list(ext)
                    nlo[d], next_ext[d] = lo[d] + c * chunk, size
                    nxt.append(((*coords, c), nlo, next_ext))
        states = nxt
    return [(coords, tuple(lo), tuple(ext)) for coords, lo, ext in states
            if all(max(a, b) < min(a + n, b + m) for a, n, b, m in zip(lo, ext, offset, box))]


@functools.lru_cache(maxsize=4096)
def local_box(shape: tuple[int, ...], mesh: tuple[int, ...], coord: tuple[int, ...],
              placements: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Pure: (global offset, shape) of the piece the mesh coordinate `coord` holds, by torch's rule
    (`compute_local_shape_and_global_offset` for Shard/Replicate placements, an empty piece's
    offset included), in O(mesh dims) and without torch's per-call overhead (a restore plan asks
    once per DTensor). Cached: a model's layers repeat a few global shapes (405B: 3,411 DTensors
    per rank, a few dozen distinct boxes); arguments and result are tuples (hashable, immutable)."""
    lo, ext = [0] * len(shape), list(shape)
    for p, n, c in zip(placements, mesh, coord):
        if p == "replicate" or n == 1:
            continue
        d = int(p[6:])
        chunk = -(-ext[d] // n)
        start = min(c * chunk, ext[d])
        lo[d] += start
        ext[d] = max(0, min(ext[d], c * chunk + chunk) - start)
    # torch places an empty piece at the end of its dimension, however it got empty
    return tuple(shape[d] if ext[d] == 0 else lo[d] for d in range(len(shape))), tuple(ext)

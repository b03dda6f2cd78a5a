"""A 4096-rank FSDP2-style manifest, committed and read back through the real code: it validates,
every rank's restore plan tiles its box, and parsing stays within a generous bound (a regression
guard only; the figures in docs/scaling.md come from scripts/scale_manifest.py)."""

from __future__ import annotations

import time
from pathlib import Path

from slurmresume.checkpoint import fsio
from slurmresume.checkpoint.jsonenc import dumps
from slurmresume.checkpoint.layout import MANIFEST, MARKER, shard_name
from slurmresume.checkpoint.manifest import build_manifest, marker_bytes, read_manifest
from slurmresume.checkpoint.rankindex import write_index
from slurmresume.checkpoint.sharding import cover

WORLD = 4096
PARAMS = {"embed": (50_000, 64), "norm": (64,)}  # norm: fewer rows than ranks, as small vectors are
DIGEST = "0123456789abcdef"


def _chunk0(dim0: int, rank: int) -> tuple[int, int]:
    size = -(-dim0 // WORLD)
    start = min(rank * size, dim0)
    return start, max(0, min(size, dim0 - start))


def _report(d: Path, rank: int) -> dict:
    tensors = {}
    for pname, shape in PARAMS.items():
        off, rows = _chunk0(shape[0], rank)
        for m in ("model", "exp_avg", "exp_avg_sq"):
            tensors[f"{m}/{pname}"] = {"dtype": "F32", "shape": [rows, *shape[1:]], "xxh3": [DIGEST],
                                       "global_shape": list(shape), "global_offset": [off] + [0] * (len(shape) - 1)}
    own = write_index(d, rank, shard_name(rank, WORLD), tensors)  # format 2: the rank's own index file
    out = {"rank": rank, "file": shard_name(rank, WORLD), "bytes": 4096, "xxh3": DIGEST, "header_xxh3": DIGEST,
           **own, "pinned": False, "error": None}
    if rank == 0:
        out["sharded"] = {n: {"dtype": "F32", "shape": t["global_shape"], "placements": ["shard:0"],
                              "mesh_shape": [WORLD]} for n, t in tensors.items()}
    return out


def test_4096_rank_manifest_parses_and_plans(tmp_path: Path) -> None:
    d = tmp_path / "step_000000001"
    d.mkdir()
    raw = dumps(build_manifest(1, [_report(d, r) for r in range(WORLD)], None, None)).encode()
    fsio.write_durable(d / MANIFEST, raw, "manifest")
    fsio.write_durable(d / MARKER, marker_bytes(1, raw), "marker")

    t0 = time.perf_counter()
    m = read_manifest(d, 1)
    parse_s = time.perf_counter() - t0
    assert m.world_size == WORLD and len(m.tensors) == WORLD * len(PARAMS) * 3
    assert parse_s < 60, f"parsing a {len(raw) >> 20} MiB manifest took {parse_s:.1f} s"

    t0 = time.perf_counter()
    for rank in (0, 1, WORLD // 2, WORLD - 1):
        for pname, shape in PARAMS.items():
            off, rows = _chunk0(shape[0], rank)
            hits = cover(m.sharded[f"model/{pname}"], (off, *([0] * (len(shape) - 1))), (rows, *shape[1:]))
            assert sum(h[2][0] for h in hits) == rows  # this rank's own piece, nothing else
            assert all(h[0].rank == rank for h in hits)
    assert time.perf_counter() - t0 < 30

"""Scale on paper, backed by measurement: the manifest and restore planning of a 7B / 70B model
sharded with FSDP2 over 8 ... 4096 ranks.

    python scripts/scale_manifest.py [--ranks 8,64,512,4096] [--models 7B,70B] [--max-entries 400000]
                                     [--rank-gbps 1.0] [--fs-gbps 100] [--json-out scale.json]

For each (model, world size) it builds the manifest exactly as a save would (checkpoint.manifest
.build_manifest over one report per rank, with a tensor entry per local piece of every parameter
and both Adam moments, Shard(0) placements as FSDP2 uses, and 4 MiB block digests), then measures
on this machine: its JSON size, encoding it (rank 0, before the marker), parsing + validating it
(every restore, `validate_manifest`: JSON, shard entries, index_pieces) and one rank's restore
planning (`cover` for every tensor it owns at the same world size). Manifests over --max-entries
tensor entries are not built: those figures are extrapolated from the largest measured one
(entries grow linearly with ranks; planning as entries x pieces) and marked "extrapolated".

Save and restore seconds are a model, not a measurement: bytes per rank / --rank-gbps (a rank's
own write speed: what scripts/bench.py measures here) or total bytes / --fs-gbps (the file
system's aggregate), whichever is slower, plus the measured manifest costs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurmresume.checkpoint.jsonenc import dumps, loads  # noqa: E402
from slurmresume.checkpoint.layout import FORMAT, index_name, shard_name  # noqa: E402
from slurmresume.checkpoint.manifest import MAX_MANIFEST, build_manifest, validate_manifest  # noqa: E402
from slurmresume.checkpoint.shard import VERIFY_BLOCK  # noqa: E402
from slurmresume.checkpoint.sharding import cover, index_pieces  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import MODELS, MOMENTS, chunk0, parameters  # noqa: E402

STATE_BYTES = 4  # fp32 sharded parameters and both Adam moments (FSDP2 keeps sharded params fp32)


def report(model: str, world: int, rank: int, params: list) -> dict:
    tensors, total = {}, 64 << 10  # a header's worth
    digest = "0123456789abcdef"
    for pname, shape in params:
        off, rows = chunk0(shape[0], world, rank)
        local = (rows, *shape[1:])
        nbytes = math.prod(local) * STATE_BYTES
        for m in MOMENTS:
            name = f"model/{pname}" if m == "param" else f"optim/state/{pname}/{m}"
            tensors[name] = {"dtype": "F32", "shape": list(local), "xxh3": [digest] * -(-nbytes // VERIFY_BLOCK),
                             "global_shape": list(shape), "global_offset": [off] + [0] * (len(shape) - 1)}
            total += nbytes
    file = shard_name(rank, world)
    index = dumps({"format": FORMAT, "rank": rank, "file": file, "tensors": tensors}).encode()
    out = {"rank": rank, "file": file, "bytes": total, "xxh3": digest, "header_xxh3": digest,
           "index": index_name(rank), "index_bytes": len(index), "index_xxh3": xxhash.xxh3_64_hexdigest(index),
           "pinned": False, "tensors": tensors, "error": None}  # "tensors": the rank's index file
    if rank == 0:  # the per-tensor section only rank 0 sends itself
        out["sharded"] = {n: {"dtype": "F32", "shape": t["global_shape"], "placements": ["shard:0"],
                              "mesh_shape": [world], "mesh_arange": True} for n, t in tensors.items()}
        out["replicated"] = []
    return out


def timed(fn, repeats: int = 3) -> float:  # noqa: ANN001
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def measure(model: str, world: int) -> dict:
    params = parameters(model)
    reports = [report(model, world, r, params) for r in range(world)]
    manifest = build_manifest(1, reports, {"loss": 1.0}, None)
    raw = dumps(manifest).encode()
    encode_s = timed(lambda: dumps(manifest).encode(), 1)
    validate_manifest(loads(raw, "m"), Path("/nonexistent/step_000000001"), 1)
    parse_s = timed(lambda: validate_manifest(loads(raw, "m"), Path("/x/step_000000001"), 1), 1)
    # the restore plan over every rank's pieces (format 2 keeps them in the ranks' index files)
    sharded = index_pieces([{"name": n, "rank": r["rank"], **t} for r in reports for n, t in r["tensors"].items()],
                           world)
    rank = world // 2

    def plan() -> None:
        for pname, shape in params:
            off, rows = chunk0(shape[0], world, rank)
            for m in MOMENTS:
                name = f"model/{pname}" if m == "param" else f"optim/state/{pname}/{m}"
                cover(sharded[name], (off, *([0] * (len(shape) - 1))), (rows, *shape[1:]))

    plan_s = timed(plan, 1)
    return {"entries": sum(len(r["tensors"]) for r in reports), "manifest_bytes": len(raw),
            "index_bytes_per_rank": max(r["index_bytes"] for r in reports), "encode_s": encode_s,
            "parse_s": parse_s, "plan_one_rank_s": plan_s, "measured": True}


def model_row(model: str, world: int, m: dict, rank_gbps: float, fs_gbps: float) -> dict:
    params = parameters(model)
    total = sum(math.prod(s) for _, s in params) * STATE_BYTES * len(MOMENTS)
    per_rank = total / world
    io = max(per_rank / (rank_gbps * 1e9), total / (fs_gbps * 1e9))
    return {"model": model, "ranks": world, "params": sum(math.prod(s) for _, s in params), "state_bytes": total,
            "bytes_per_rank": per_rank, **m, "over_manifest_limit": m["manifest_bytes"] > MAX_MANIFEST,
            "save_s": io + m["encode_s"], "restore_s": io + m["parse_s"] + m["plan_one_rank_s"]}


def marker_cost(directory: Path, n: int = 20) -> dict:
    """Median seconds of a durable marker (temp, fsync, rename, dir fsync) and of a durable
    manifest of `size` bytes, on the disk holding `directory`."""
    import shutil
    import tempfile

    from slurmresume.checkpoint import fsio

    d = Path(tempfile.mkdtemp(prefix="scale-marker-", dir=directory))
    try:
        marker = timed(lambda: fsio.write_durable(d / "COMMITTED", b'{"step":1,"manifest_xxh3":"0123456789abcdef"}',
                                                  "marker"), n)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return {"marker_s": marker}


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--ranks", default="8,64,512,4096", help="world sizes, comma separated")
    ap.add_argument("--models", default="7B,70B", help="of: " + ", ".join(MODELS))
    ap.add_argument("--max-entries", type=int, default=400_000, help="build manifests up to this many entries")
    ap.add_argument("--rank-gbps", type=float, default=1.0, help="one rank's durable write speed, GB/s")
    ap.add_argument("--fs-gbps", type=float, default=100.0, help="the file system's aggregate speed, GB/s")
    ap.add_argument("--dir", default="/tmp", help="where to time the durable marker")
    ap.add_argument("--json-out", default=None, help="also write the figures there as JSON")
    args = ap.parse_args()
    try:
        worlds = [int(x) for x in args.ranks.split(",")]
    except ValueError:
        ap.error(f"--ranks {args.ranks!r}: expected positive integers separated by commas, e.g. 8,64")
    if any(w < 1 for w in worlds) or any(m not in MODELS for m in args.models.split(",")):
        ap.error(f"--ranks must be positive and --models among {', '.join(MODELS)}")
    marker = marker_cost(Path(args.dir))
    print(f"durable commit marker (temp, fsync, rename, dir fsync): {marker['marker_s'] * 1e3:.2f} ms median of 20")
    rows = []
    for model in args.models.split(","):
        per_rank_entries = len(parameters(model)) * len(MOMENTS)
        last: tuple[int, dict] | None = None
        for world in worlds:
            if per_rank_entries * world <= args.max_entries or last is None:
                m = measure(model, world)
                last = (world, m)
            else:  # linear in entries; planning: entries of one rank x pieces per tensor (= world)
                w0, m0 = last
                k = world / w0
                m = {"entries": m0["entries"] * k, "manifest_bytes": m0["manifest_bytes"] * k,
                     "index_bytes_per_rank": m0["index_bytes_per_rank"],
                     "encode_s": m0["encode_s"] * k, "parse_s": m0["parse_s"] * k,
                     "plan_one_rank_s": m0["plan_one_rank_s"] * k, "measured": False}
            rows.append(model_row(model, world, m, args.rank_gbps, args.fs_gbps))
            r = rows[-1]
            print(f"{model:>4s} {world:5d} ranks: {r['bytes_per_rank'] / 1e9:8.2f} GB/rank, "
                  f"{r['entries']:>10,.0f} entries, manifest {r['manifest_bytes']:,.0f} B "
                  f"+ {r['index_bytes_per_rank']:,.0f} B index per rank"
                  f"{' (OVER the 64 MiB limit)' if r['over_manifest_limit'] else ''}, encode {r['encode_s']:.2f} s, "
                  f"parse {r['parse_s']:.2f} s, plan one rank {r['plan_one_rank_s']:.2f} s, "
                  f"save ~{r['save_s']:.1f} s, restore ~{r['restore_s']:.1f} s"
                  f"{'' if r['measured'] else '  [extrapolated]'}", flush=True)
    data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rank_gbps": args.rank_gbps, **marker,
            "fs_gbps": args.fs_gbps, "rows": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()

"""torch.distributed.checkpoint (DCP) at 8 ... 16,384 ranks, measured the way bench_scale.py measures ours.

    python scripts/bench_scale_dcp.py [--ranks 8,512,1024,4096] [--models 7B,70B] [--reshard 4096:3072]
                                      [--caching] [--json-out dcp.json]
    python scripts/bench_scale.py ... --peer dcp      # the same, each row beside ours

The state bench_scale.py measured before issue #50 (bench_world's `moments_state`: every parameter and both Adam moments as FSDP2
Shard(0) DTensors on the fake backend's DeviceMesh, fp32), through DCP's own code in the order
`dcp.save`/`dcp.load` call it (`state_dict_saver._save_state_dict`, `state_dict_loader._load_state_dict`):

- save: rank 0's `DefaultSavePlanner.set_up_planner` + `create_local_plan` and `FileSystemWriter
  .prepare_local_plan` (timed: what every rank does); every other rank's local plan is rank 0's
  with each chunk's offset and size from DCP's own `compute_local_shape_and_global_offset` on that
  rank's mesh coordinate (a `DeviceMesh(_rank=i)`; built, not timed). The coordinator's part is
  timed in CPU seconds: unpickling the W gathered plans (`gather_object`), `create_global_plan`
  (dedup, metadata, validation) + `prepare_global_plan`, pickling the W plans it scatters, rank 0's
  `finish_plan`, unpickling the W gathered write results, `FileSystemWriter.finish` (the real
  `.metadata`, pickled, tmp + rename) and pickling the metadata `all_reduce` broadcasts to every rank.
  No tensor byte is written: each rank's write results are what `FileSystemWriter` records for one
  file per rank (`__i_0.distcp`, items back to back, raw tensor lengths).
- bytes: from the pickled sizes and torch's object collectives (`gather_object` all-gathers the
  sizes, then pads every payload to the largest; `scatter_object_list` likewise; the save ends with
  `broadcast_object_list` of the whole metadata to every rank).
- restore: rank 0 of a `to`-rank job: `FileSystemReader.read_metadata` (every rank unpickles the
  whole `.metadata`) + `DefaultLoadPlanner.set_up_planner` + `create_local_plan` (its reads,
  resharding included), CPU seconds and, in a second pass, peak Python heap (tracemalloc).
- metadata operations: counted as bench_world's `Ops` counts ours (os seam, plus Python's `open`
  and `os.fsync`, counted and not performed) around rank 0's and the coordinator's real calls; a
  rank's data file is one create + one fsync (`_write_files_from_queue`, one file per rank), and a
  restoring rank opens each file its plan reads once (`read_data`), counted from its plan.
- `--caching`: then a second save with `DefaultSavePlanner(enable_plan_caching=True)`, every rank's
  local plan unchanged (each rank's cache hits and it sends an empty plan, as rank 0's real one does).

A point whose write items (W x tensors) exceed --max-items, or whose time predicted from the last
point (linear in W x tensors) exceeds --max-seconds, is not run and is reported with the reason.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_world import Ops, fake_world, mib  # noqa: E402
from bench_world import moments_state as rank_state  # noqa: E402
from model_shapes import MODELS, MOMENTS, parameters  # noqa: E402
from torch.distributed.checkpoint import (  # noqa: E402
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex  # noqa: E402
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType  # noqa: E402
from torch.distributed.checkpoint.storage import WriteResult  # noqa: E402

LONG = 8  # one int64: a size in the object collectives
DEFAULT_MAX_ITEMS = 6_000_000  # write items held at once (W x tensors): ~GBs of Python objects


@contextlib.contextmanager
def counting(ops: Ops) -> Iterator[Any]:
    """bench_world's Ops, plus what DCP's FileSystem calls that ours does not: Python's `open`
    (Path.open) and `os.fsync` (counted, not performed)."""
    with ops.counting() as counts:
        real_open, real_fsync = io.open, os.fsync

        def opened(file: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
            counts["create" if any(c in mode for c in "wax") else "open"] += 1
            return real_open(file, mode, *a, **k)
        io.open = builtins.open = opened  # type: ignore[assignment]
        os.fsync = lambda fd: counts.update(["fsync"])  # type: ignore[assignment]
        try:
            yield counts
        finally:
            io.open = builtins.open = real_open  # type: ignore[assignment]
            os.fsync = real_fsync


def _cpu() -> float:
    return time.process_time()


def peer_plan(plan0: SavePlan, world: int, rank: int) -> SavePlan:
    """Rank `rank`'s local save plan: rank 0's items, each DTensor chunk as DCP computes it on
    that rank (`compute_local_shape_and_global_offset` on a mesh whose coordinate is `rank`)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = DeviceMesh("cpu", torch.arange(world), _init_backend=False, _rank=rank)
    boxes: dict[tuple[int, ...], tuple[torch.Size, torch.Size]] = {}
    items = []
    for it in plan0.items:
        if it.type != WriteItemType.SHARD or it.tensor_data is None:
            items.append(it)
            continue
        size = tuple(it.tensor_data.size)
        if size not in boxes:
            sizes, offsets = compute_local_shape_and_global_offset(torch.Size(size), mesh, [Shard(0)])
            boxes[size] = torch.Size(sizes), torch.Size(offsets)
        sizes, offsets = boxes[size]
        items.append(dataclasses.replace(
            it, index=MetadataIndex(it.index.fqn, offsets),
            tensor_data=dataclasses.replace(it.tensor_data, chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes))))
    return dataclasses.replace(plan0, items=items)


def write_results(plan: SavePlan, rank: int) -> list[WriteResult]:
    """What FileSystemWriter returns for rank `rank`'s `plan` (one file per rank, `prepare_global_plan`'s
    prefix `__{rank}_`, items back to back)."""
    out, offset = [], 0
    for it in plan.items:
        chunk = it.tensor_data.chunk if it.tensor_data is not None else None
        n = 4 * (int(torch.Size(chunk.sizes).numel()) if chunk is not None else 1)
        out.append(WriteResult(index=it.index, size_in_bytes=n,
                               storage_data=_StorageInfo(f"__{rank}_0.distcp", offset, n)))
        offset += n
    return out


class Coordinator:
    """The coordinator's CPU seconds per phase, and each object collective's bytes."""

    def __init__(self, world: int) -> None:
        self.world, self.cpu = world, {}  # type: ignore[var-annotated]
        self.received = {"rank0": 0, "other": 0}
        self.sent_other = 0

    def timed(self, phase: str, f: Any, *a: Any) -> Any:
        t = _cpu()
        out = f(*a)
        self.cpu[phase] = self.cpu.get(phase, 0.0) + _cpu() - t
        return out

    def gather(self, phase: str, objs: Iterator[Any]) -> list[Any]:
        """gather_object of each rank's object: the sizes all-gathered, payloads padded to the max;
        the coordinator unpickles every one (timed)."""
        out, sizes = [], []
        for obj in objs:
            blob = pickle.dumps(obj)
            sizes.append(len(blob))
            out.append(self.timed(phase, pickle.loads, blob))
        for who in ("rank0", "other"):
            self.received[who] += LONG * self.world
        self.received["rank0"] += max(sizes) * (self.world - 1)
        self.sent_other += LONG + max(sizes)
        return out

    def scatter(self, phase: str, objs: list[Any]) -> None:
        sizes = self.timed(phase, lambda: [len(pickle.dumps(o)) for o in objs])
        self.received["other"] += LONG + max(sizes) + LONG

    def broadcast(self, phase: str, obj: Any) -> int:
        n = self.timed(phase, lambda: len(pickle.dumps(obj)))
        self.received["other"] += LONG + n
        return n


def save(model: str, world: int, directory: Path, ops: Ops, caching: bool = False,
         second: bool = False) -> dict[str, Any]:
    """One W-rank DCP save of `model` into `directory` (see the module docstring). With `second`,
    the save after a first one with plan caching: every rank's plan unchanged."""
    mesh = fake_world(world)
    state = rank_state(model, mesh, world, 0)
    writer = FileSystemWriter(directory)
    planner = DefaultSavePlanner(enable_plan_caching=caching)
    co = Coordinator(world)
    with counting(ops) as counts:
        t = _cpu()
        planner.set_up_planner(state_dict=state, storage_meta=writer.storage_meta(), is_coordinator=True)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        local0 = writer.prepare_local_plan(planner.create_local_plan())
        local_s, rank_ops = _cpu() - t, Ops.total(counts)
    peers = (local0 if second else peer_plan(local0, world, r) for r in range(1, world))
    plans = co.gather("gather plans", iter([local0, *peers]))
    global_plans, metadata = co.timed("global plan", planner.create_global_plan, plans)
    global_plans = co.timed("global plan", writer.prepare_global_plan, global_plans)
    co.scatter("scatter plans", global_plans)
    final0 = co.timed("finish_plan", planner.finish_plan, global_plans[0])
    full = SavePlanner._cached_global_plan.get(planner._cached_plans_key, global_plans) if caching else global_plans
    results = co.gather("gather results", (write_results(final0 if r == 0 else full[r], r) for r in range(world)))
    with counting(ops) as counts:
        co.timed("metadata write", writer.finish, metadata, results)
        finish_ops = dict(counts)
    meta_bytes = co.broadcast("broadcast metadata", metadata)
    covered = all(sum(torch.Size(c.sizes).numel() for c in md.chunks) == torch.Size(md.size).numel()
                  for md in metadata.state_dict_metadata.values())  # with DCP's own no-overlap check: tiled
    # per rank: its prepare_local_plan (rank_ops) + its data file's create and fsync; + the coordinator's finish
    save_ops = world * (rank_ops + 2) + Ops.total(Counter(finish_ops))
    return {"model": model, "ranks": world, "caching": caching, "second": second,
            "metadata_bytes": (directory / ".metadata").stat().st_size, "covered": covered, "broadcast_bytes": meta_bytes,
            "local_plan_cpu_s": local_s, "coordinator_cpu": co.cpu, "coordinator_cpu_s": sum(co.cpu.values()),
            "received": co.received, "sent_other": co.sent_other, "items": sum(len(p.items) for p in full),
            "save_ops_total": save_ops, "save_ops_rank": rank_ops + 2, "save_ops_coordinator": finish_ops}


def load_plan(model: str, world: int, directory: Path, ops: Ops, memory: bool = True) -> dict[str, Any]:
    """Rank 0 of a `world`-rank job planning its DCP load of the checkpoint in `directory`."""
    mesh = fake_world(world)
    state = rank_state(model, mesh, world, 0)

    def plan() -> Any:
        reader = FileSystemReader(directory)
        metadata = reader.read_metadata()
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state, metadata, True)
        reader.set_up_storage_reader(metadata, True, rank=0, use_collectives=True)
        return reader, reader.prepare_local_plan(planner.create_local_plan())

    with counting(ops) as counts:
        t, w = _cpu(), time.perf_counter()
        reader, local = plan()
        out: dict[str, Any] = {"to": world, "plan_cpu_s": _cpu() - t, "plan_s": time.perf_counter() - w,
                               "plan_ops": Ops.total(counts)}
    files = {reader.storage_data[ri.storage_index].relative_path for ri in local.items}
    out.update(read_items=len(local.items), files_read=len(files), plan_bytes=len(pickle.dumps(local)),
               restore_ops_rank=out["plan_ops"] + len(files))
    out["restore_ops_total"] = world * out["restore_ops_rank"]
    if memory:
        del reader, local
        tracemalloc.start()
        plan()
        out["plan_peak_bytes"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return out


def measure(model: str, world: int, reshard_to: int | None, workdir: Path, memory: bool = True,
            caching: bool = False) -> dict[str, Any]:
    """One (model, W) point: the save, the same-W and resharding load plans, and with `caching`
    the second save with plan caching. Leaves nothing behind."""
    root = Path(tempfile.mkdtemp(prefix=f"dcp-{model}-{world}-", dir=workdir))
    ops = Ops()
    wall = time.perf_counter()
    try:
        _clear_caches()
        row = save(model, world, root / "plain", ops)
        row["same"] = load_plan(model, world, root / "plain", ops, memory)
        if reshard_to:
            row["reshard"] = {"from": world, **load_plan(model, reshard_to, root / "plain", ops, memory)}
        if caching:
            save(model, world, root / "cached-1", ops, caching=True)
            row["cached"] = save(model, world, root / "cached-2", ops, caching=True, second=True)
        row["wall_s"] = time.perf_counter() - wall
        return row
    finally:
        _clear_caches()
        shutil.rmtree(root, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _clear_caches() -> None:
    for cache in (SavePlanner._cached_save_plan, SavePlanner._cached_all_plans, SavePlanner._cached_global_plan,
                  SavePlanner._cached_metadata, SavePlanner._cached_final_save_plan):
        cache.clear()


def tensors(model: str) -> int:
    return len(parameters(model)) * len(MOMENTS)


def line(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"{r['model']:>4s} {r['ranks']:6d} ranks DCP: not run ({r['skipped']})"
    cpu = r["coordinator_cpu"]
    s = (f"{r['model']:>4s} {r['ranks']:6d} ranks DCP: .metadata {mib(r['metadata_bytes'])}; coordinator "
         f"{r['coordinator_cpu_s']:.3f} s cpu (global plan {cpu.get('global plan', 0):.3f}, metadata write "
         f"{cpu.get('metadata write', 0):.3f}); local plan (one rank) {r['local_plan_cpu_s'] * 1e3:.1f} ms; save recv "
         f"rank0 {mib(r['received']['rank0'])} other {mib(r['received']['other'])}, sent other "
         f"{mib(r['sent_other'])}; save ops {r['save_ops_total']:,}")
    for key in ("same", "reshard"):
        p = r.get(key)
        if p is not None:
            s += (f"\n      load plan {r['ranks']}->{p['to']} (one rank): {p['plan_cpu_s'] * 1e3:.1f} ms cpu "
                  f"({p['plan_s'] * 1e3:.1f} wall), peak heap {mib(p.get('plan_peak_bytes'))}, reads "
                  f"{p['files_read']} file(s); ops per rank {p['restore_ops_rank']} ({p['restore_ops_total']:,} in all)")
    c = r.get("cached")
    if c is not None:
        s += (f"\n      second save with plan caching: coordinator {c['coordinator_cpu_s']:.3f} s cpu (global plan "
              f"{c['coordinator_cpu'].get('global plan', 0):.3f}), recv rank0 {mib(c['received']['rank0'])} other "
              f"{mib(c['received']['other'])}")
    return s


def skip_reason(model: str, world: int, last: tuple[int, float] | None, max_items: int,
                max_seconds: float) -> str | None:
    """Why (model, world) is not run, or None: too many write items to hold, or too long predicted
    from the last point run at >= 256 ranks (linear in W: a lower bound where DCP's planning is
    superlinear)."""
    items = world * tensors(model)
    if items > max_items:
        return f"{items:,} write items over --max-items {max_items:,}"
    if last is not None and last[0] >= 256 and last[1] * world / last[0] > max_seconds:  # below: fixed costs
        return f"predicted over {last[1] * world / last[0]:.0f} s (linear from {last[0]} ranks), over --max-seconds"
    return None


def beside(model: str, world: int, reshard_to: int | None, workdir: Path, memory: bool = True) -> dict[str, Any]:
    """bench_scale.py --peer dcp: this point measured for DCP (with plan caching), unless the
    default --max-items rule skips it."""
    why = skip_reason(model, world, None, DEFAULT_MAX_ITEMS, 0)
    if why:
        return {"model": model, "ranks": world, "skipped": why}
    return measure(model, world, reshard_to, workdir, memory, caching=True)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--ranks", default="8,512,1024,4096", help="world sizes, comma separated")
    ap.add_argument("--models", default="7B,70B,405B", help="of: " + ", ".join(MODELS))
    ap.add_argument("--reshard", default="4096:3072", help="FROM:TO,...: also plan rank 0's load on TO ranks ('' for none)")
    ap.add_argument("--caching", action="store_true", help="also a second save with enable_plan_caching=True")
    ap.add_argument("--max-items", type=int, default=DEFAULT_MAX_ITEMS, help="skip a point with more write items (W x tensors)")
    ap.add_argument("--max-seconds", type=float, default=600.0, help="skip a point predicted to take longer")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass (peak heap of the load plan)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the .metadata files are written")
    ap.add_argument("--json-out", default=None, help="also write every figure there as JSON")
    args = ap.parse_args(argv)
    try:
        worlds = [int(x) for x in args.ranks.split(",")]
        reshard = {int(a): int(b) for a, _, b in (p.partition(":") for p in args.reshard.split(",") if p)}
    except ValueError:
        ap.error(f"--ranks {args.ranks!r} / --reshard {args.reshard!r}: expected integers (8,64 and 4096:3072)")
    models = args.models.split(",")
    if any(w < 2 for w in worlds) or any(m not in MODELS for m in models) or any(v < 1 for v in reshard.values()):
        ap.error(f"--ranks must be at least 2 and --models among {', '.join(MODELS)}")
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs (shared, loaded), "
          f"torch {torch.__version__}", flush=True)
    rows = []
    for model in models:
        last: tuple[int, float] | None = None  # (world, wall seconds)
        for world in worlds:
            why = skip_reason(model, world, last, args.max_items, args.max_seconds)
            if why:
                row: dict[str, Any] = {"model": model, "ranks": world, "skipped": why}
            else:
                row = measure(model, world, reshard.get(world), Path(args.dir), not args.no_memory, args.caching)
                last = (world, row["wall_s"])
            rows.append(row)
            print(line(row), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                   "torch": torch.__version__, "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The save and restore paths at 8 ... 16,384 ranks, on one machine: what grows with the world size.

    python scripts/bench_scale.py [--ranks 8,64,512,4096,16384] [--models 7B,70B,405B]
                                  [--reshard 64:48,16384:12288] [--read] [--json-out scale.json]
                                  [--peer dcp]   (DCP measured the same way: scripts/bench_scale_dcp.py)
                                  [--exact-emulation] [--drop-stamped] [--step-digest]

One process plays rank 0 of a W-rank job: torch.distributed's "fake" backend with FakeStore and
`init_device_mesh` give it a real DeviceMesh and real DTensors (FSDP2 `Shard(0)` placements of the
model's parameters and both Adam moments, fp32). The fake backend's collectives hand every rank its
own input back; here they carry each rank's own input (`Fabric`): what rank i would send is what
the real `checkpoint.commit.write_rank` returned when this process ran it as rank i. Every rank's
shard is "synthetic and sparse" (`SparseShards`): the real safetensors header for the ranks whose
files a measured restore reads, and for every rank a file of the right size made by ftruncate, its
tensor bytes never written (zeros on read), their block digests those of zeros. So W files exist
and every restore check that opens them runs for real, without 80 GB ... 4.9 TB of tensors.
The ranks whose local shapes repeat are "stamped" from a template that the real write_rank made
(scripts/bench_stamp.py: the same bytes and the same calls, checked against the real write_rank on
every run for rank 0, ranks 1-3 and the first and last rank of each group); `--exact-emulation`
runs write_rank for every rank (70B at 16,384 ranks: hours on a loaded machine).

Per (model, W) it prints:
- manifest bytes (what the code's format writes; a step the save refuses is reported as refused);
- bytes each rank sends and receives during the save, for rank 0 and for any other rank, as gloo's
  algorithms move them (`received_bytes`: a ring all_reduce, 2 (W - 1) / W of its tensor; gather:
  only the root receives), per kind of collective and per call;
- rank 0's commit metadata time, wall and CPU: gather of the reports -> manifest -> marker ->
  publish (the part of a save between the last shard's fsync and "saved");
- the restore plan: rank 0's `pick` (it chooses the step for everyone, and keeps its parse of
  the manifest) and its plan, and the plan of a rank that is not 0, at its own coordinate (the choice and
  the manifest's bytes as they arrive by broadcast: that rank parses those bytes and never opens
  manifest.json), seconds and peak Python heap (tracemalloc, a second pass); the bytes of both
  broadcasts (what every rank but 0 receives); the same for --reshard's target world (e.g.
  16,384 -> 12,288);
- metadata operations per save (all ranks: the job's total) and per restore (pick + rank 0's
  plan + (W - 1) x another rank's plan), counted at the os seam (open/create, stat, mkdir,
  rename, unlink, listdir, scandir) and through checkpoint.fsio's labels (fsync, directory
  fsync). A directory listing counts one operation (plus one per DirEntry.stat, which none of
  these paths calls); an fstat on an open file counts none (the open counted). fsyncs are
  counted, not performed: this measures CPU and operation counts, not the disk.

The save is the production one (issue #50): `roots.claim_root` and `train.saving.save_collective`
as `Checkpointer.save` calls them, replica detection included, on the state FSDP2 + torch.optim.Adam
hand the Checkpointer (`rank_state`: DTensor parameters and moments, a plain 0-dim `step` per
parameter, `param_groups`; the library adds its RNG tensors): every plain tensor is the same on
every rank, so the detection finds them all replicated. The other ranks' shards are written
through the seam `save_collective` calls (`commit.write_rank`), before rank 0's own. Bytes are
counted as gloo moves them (`received_bytes`; tests/test_bench_scale.py checks them against a
real 8-rank FSDP2 + Adam save). A restore plan is timed as `restoreload.load_choice` runs it
(`plan_part`, then `exchange_plan`) on rank 0 and on a rank in the middle of the world, at its
own coordinate (`other_rank`).

A (model, W) whose manifest would exceed --max-manifest-mib (extrapolated linearly in W from the
last one measured) is not built: it is reported with the predicted size (building a multi-GiB
manifest on a shared machine measures only the swap). The CPU here is shared and loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_nodefile  # noqa: E402
import bench_stamp  # noqa: E402
import numpy  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import xxhash  # noqa: E402
from bench_world import Ops, fake_world, mib  # noqa: E402
from model_shapes import MODELS, chunk0, parameters  # noqa: E402

from slurmresume.checkpoint import (  # noqa: E402
    commit,
    fsio,
    shardread,  # noqa: E402
)
from slurmresume.checkpoint import shard as shard_mod  # noqa: E402
from slurmresume.checkpoint.collective import Group  # noqa: E402
from slurmresume.checkpoint.layout import MANIFEST, step_dir_name  # noqa: E402
from slurmresume.checkpoint.manifest import MAX_MANIFEST  # noqa: E402
from slurmresume.checkpoint.replicas import replicated_across  # noqa: E402
from slurmresume.checkpoint.reports import WriteReport  # noqa: E402
from slurmresume.checkpoint.state import flatten_live  # noqa: E402
from slurmresume.train import (  # noqa: E402
    claims,  # noqa: E402
    messages,
    restorechoice,
    restoreload,
    restoreplan,
)
from slurmresume.train.roots import claim_root  # noqa: E402
from slurmresume.train.saving import payload_of, save_collective  # noqa: E402

STEP = 100


# -- the fake collectives -------------------------------------------------------------------------

def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def received_bytes(kind: str, nbytes: int, world: int, coordinator: bool) -> int:
    """Tensor bytes one rank receives in one collective over a gloo group of `world` ranks, as
    gloo's algorithms move them (`nbytes`: the tensor passed; all_gather and gather: each rank's
    piece): all_reduce, ring (reduce-scatter, then all-gather: 2 (W - 1) / W of the tensor, on
    every rank); broadcast, the tensor into each rank but the root; gather, W - 1 pieces into the
    root, nothing into the others; all_gather, the W - 1 other pieces. Per-message framing (TCP
    and gloo headers, ~50 B a message) is not counted: tests/helpers/fsdp_save_bytes.py measures
    it beside these figures on real gloo ranks."""
    if kind == "all_reduce":
        return 2 * nbytes * (world - 1) // world
    if kind == "broadcast":
        return 0 if coordinator else nbytes
    if kind == "gather":
        return nbytes * (world - 1) if coordinator else 0
    if kind == "all_gather":
        return nbytes * (world - 1)
    raise ValueError(kind)


class Fabric:
    """The fake backend's collectives, made to carry each rank's own input: while `peers` holds
    one JSON payload per rank (`Group.all_gather_json`'s length-then-bytes protocol), an
    all_gather or gather hands rank i's payload to slot i; otherwise every slot gets this rank's
    input (a broadcast from rank 0, a verdict everyone agrees on). Counts the bytes rank 0 and any
    other rank send and receive, per collective as gloo moves them (`received_bytes`), and per
    kind of collective what a non-zero rank receives (`by_collective`)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.peers: list[bytes] | None = None
        self.sent = {"rank0": 0, "other": 0}
        self.received = {"rank0": 0, "other": 0}
        self.calls: Counter[str] = Counter()
        self.by_collective: Counter[str] = Counter()
        self.log: list[list[Any]] = []  # [kind, tensor bytes, bytes a non-zero rank receives] per call

    def _count(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        got0, got = (received_bytes(kind, nbytes, self.world, c) for c in (True, False))
        self.received["rank0"] += got0
        self.received["other"] += got
        self.by_collective[kind] += got
        self.log.append([kind, nbytes, got])
        # what a rank sends, by the same algorithms: a ring all_reduce sends what it receives
        self.sent["rank0"] += nbytes * (self.world - 1) if kind == "broadcast" else got0 if kind == "all_reduce" else nbytes
        self.sent["other"] += got if kind == "all_reduce" else 0 if kind == "broadcast" else nbytes

    def _slot(self, i: int, own: Any, out: Any) -> None:
        if self.peers is None or i == 0:
            out.copy_(own)
        elif own.dtype == torch.int64 and own.numel() == 1:
            out.fill_(len(self.peers[i]))
        else:
            raw = self.peers[i]
            raw = raw + b" " * (len(out) - len(raw))  # padded as Group.gather_json pads (JSON ignores it)
            out.zero_()
            if raw:
                out[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def all_gather(self, outputs: list[Any], tensor: Any, group: Any = None, async_op: bool = False) -> None:
        for i, out in enumerate(outputs):
            self._slot(i, tensor, out)
        self._count("all_gather", _nbytes(outputs[1]) if len(outputs) > 1 else _nbytes(tensor))

    def gather(self, tensor: Any, gather_list: list[Any] | None = None, dst: int = 0, group: Any = None,
               async_op: bool = False, **_: Any) -> None:
        for i, out in enumerate(gather_list or ()):
            self._slot(i, tensor, out)
        self._count("gather", _nbytes(tensor))

    def broadcast(self, tensor: Any, src: int = 0, group: Any = None, async_op: bool = False, **_: Any) -> None:
        self._count("broadcast", _nbytes(tensor))

    def all_reduce(self, tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
        if self.peers is not None and tensor.numel() == 1:  # gather_json's MAX of the record lengths
            tensor.fill_(max(len(p) for p in self.peers))
        self._count("all_reduce", _nbytes(tensor))
        return None

    @contextlib.contextmanager
    def installed(self) -> Iterator[Fabric]:
        saved = {n: getattr(dist, n) for n in ("all_gather", "gather", "broadcast", "all_reduce")}
        for n in saved:
            setattr(dist, n, getattr(self, n))
        try:
            yield self
        finally:
            for n, f in saved.items():
                setattr(dist, n, f)


# -- synthetic sparse shards ----------------------------------------------------------------------

_ZERO_DIGESTS: dict[int, str] = {}


def zero_digest(n: int) -> str:
    if n not in _ZERO_DIGESTS:
        _ZERO_DIGESTS[n] = xxhash.xxh3_64_hexdigest(bytes(n))
    return _ZERO_DIGESTS[n]


def zero_blocks(nbytes: int) -> list[str]:
    block = shard_mod.VERIFY_BLOCK
    full, rest = divmod(nbytes, block)
    return [zero_digest(block)] * full + ([zero_digest(rest)] if rest else [])


def _owns_memory(t: Any) -> bool:
    """A CPU tensor with its own bytes (not a meta tensor, not one float expanded) of at most 1 MiB."""
    return t.device.type == "cpu" and 0 not in t.stride() and _nbytes(t) <= 1 << 20


def zero_digests(tensors: list[tuple[str, Any]], metadata: dict[str, str]) -> tuple[dict[str, Any], dict[str, str]]:
    """What shard.plan_shard puts in a header (its fine digests and its block digests, for the
    tensors `shard.digest_layout` names) for these tensors, whose bytes are zeros unless they own
    their memory (`_owns_memory`: hashed as they are): the real writer's choices, from shapes."""
    stripes, blocked = shard_mod.digest_layout(tensors, shard_mod.dtensor_specs(metadata.get(shard_mod.SKELETON_KEY, "")))
    wanted = set(blocked)
    fine: dict[str, Any] = {}
    blocks: dict[str, str] = {}
    for name, t in tensors:
        if name in stripes:
            dim, width = stripes[name]
            if _owns_memory(t):
                digests = shard_mod.stripe_digests(t.detach(), dim, width)
            else:
                unit = _nbytes(t) // t.shape[dim]
                full, rest = divmod(t.shape[dim], width)
                digests = [zero_digest(width * unit)] * full + ([zero_digest(rest * unit)] if rest else [])
            fine[name] = {"dim": dim, "width": width, "xxh3": digests}
        elif name in wanted:
            raw = bytes(shardread.byte_view(t.detach().contiguous())) if _owns_memory(t) else None
            blocks[name] = "".join(shard_mod.block_digests(memoryview(raw)) if raw is not None else zero_blocks(_nbytes(t)))
    return fine, blocks


class SparseShards:
    """Stands in for checkpoint.shard.write_shard (the module attribute commit.write_rank calls):
    the same header (real for every file, so any rank's restore can read its own), the file
    ftruncated to its full size (tensor bytes are zeros, never written), block digests of zeros,
    and the same create / fsync / rename sequence as the real writer. `last`: the last call's
    (header, bytes of tensor data, [(offset in the data, bytes) of the tensors written])."""

    last: tuple[bytes, int, list[tuple[int, bytes]]] = (b"", 0, [])

    def __call__(self, directory: Path, file: str, tensors: list[tuple[str, Any]],
                 metadata: dict[str, str], beside: Any = None) -> Any:
        tensors = shard_mod.order_for_alignment(tensors)
        fine, blocks = zero_digests(tensors, metadata)
        header, index, _ = shard_mod.header_with_digests(tensors, metadata, fine, blocks)
        data, real = 0, []
        for name, t in tensors:
            n = _nbytes(t)
            if _owns_memory(t):  # the library's own state (RNG) and any small plain tensor: its bytes
                raw = bytes(shardread.byte_view(t.detach().contiguous()))
                real.append((data, raw))
                block = shard_mod.VERIFY_BLOCK
                index[name]["xxh3"] = [xxhash.xxh3_64_hexdigest(raw[i:i + block]) for i in range(0, n, block)]
            else:
                index[name]["xxh3"] = zero_blocks(n)
            data += n
        tmp = directory / f".{file}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, header)
            os.ftruncate(fd, len(header) + data)
            for offset, raw in real:
                os.pwrite(fd, raw, len(header) + offset)
            fsio.fsync_fd(fd, "shard", tmp)
        finally:
            os.close(fd)
        self.last = (header, data, real)
        if beside is not None:  # the rank's index file, which the real writer writes during that fsync
            beside(index)
        fsio.rename(tmp, directory / file, "shard")
        return shard_mod.WrittenShard(file=file, bytes=len(header) + data, xxh3="0" * 16, tensors=index,
                                      header_xxh3=xxhash.xxh3_64_hexdigest(header), writer="sparse")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        real = commit.write_shard
        commit.write_shard = self  # type: ignore[assignment]
        try:
            yield
        finally:
            commit.write_shard = real


# -- one rank's state -----------------------------------------------------------------------------

def adam_groups(params: int) -> list[dict[str, Any]]:
    """`param_groups` of torch.optim.Adam's state_dict() over `params` parameters (its own keys)."""
    group = torch.optim.Adam([torch.zeros(1)], lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1).state_dict()["param_groups"][0]
    return [{**group, "params": list(range(params))}]


def rank_state(model: str, mesh: Any, world: int, rank: int, zeros: bool = False) -> dict[str, Any]:
    """Rank `rank`'s state as FSDP2 + torch.optim.Adam hand it to the Checkpointer: "model", every
    parameter a Shard(0) DTensor on `mesh` (fp32); "optim", Adam's state_dict(): per parameter
    (by index) its `step`, a 0-dim plain tensor (the same on every rank: not a DTensor), and both
    moments as DTensors, and `param_groups` (JSON). A DTensor's local piece is one float expanded
    to the piece's shape (distinct storage per tensor, as `flatten`'s tied-weight detection needs;
    4 bytes of memory), or with `zeros` real zeros (for a restore that reads). The library adds
    its own RNG state (`payload_of`: plain tensors, the same on every rank of a seeded run)."""
    from torch.distributed.tensor import DTensor, Shard

    def piece(shape: tuple[int, ...]) -> Any:
        _, rows = chunk0(shape[0], world, rank)
        local = (rows, *shape[1:])
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        t = torch.zeros(local) if zeros else torch.zeros(1).expand(local)
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape), stride=stride)

    params = parameters(model)
    weights = {pname: piece(shape) for pname, shape in params}
    optim = {"state": {i: {"step": torch.tensor(float(STEP)), "exp_avg": piece(shape), "exp_avg_sq": piece(shape)}
                       for i, (_, shape) in enumerate(params)},
             "param_groups": adam_groups(len(params))}
    return {"model": weights, "optim": optim}


def peer_payload(template: Any, model: str, world: int, rank: int,
                 offsets: dict[int, int] | None = None) -> tuple[dict[str, Any], list[Any]]:
    """Rank `rank`'s (skeleton, tensors) from rank 0's payload: the same names and plain tensors
    (replicas: the same bytes), this rank's piece offsets and local shapes (what `flatten` gives
    on that rank), meta tensors of those shapes. `offsets` (dim-0 length -> global offset)
    replaces the offsets (bench_stamp's sentinels)."""
    specs = dict(template.skeleton.get("dtensors") or {})
    tensors = []
    for name, t in template.tensors:
        if name not in specs:
            tensors.append((name, t))
            continue
        shape = tuple(specs[name]["shape"])
        off, rows = chunk0(shape[0], world, rank)
        off = off if offsets is None else offsets[shape[0]]
        specs[name] = {**specs[name], "offset": [off, *[0] * (len(shape) - 1)], "local_shape": [rows, *shape[1:]]}
        tensors.append((name, torch.empty((rows, *shape[1:]), device="meta")))
    return {**template.skeleton, "dtensors": specs}, tensors


# -- the save (rank 0's view) ---------------------------------------------------------------------

def save_rank0(model: str, world: int, root: Path, ops: Ops, per_node: int = 0, exact: bool = False,
               drop: bool = False, keep: frozenset[int] = frozenset()) -> dict[str, Any]:
    """One W-rank save of `model` into `root`, as rank 0 runs it in `Checkpointer.save`: the
    root's lease (`roots.claim_root`, its verdict broadcast), then the production
    `train.saving.save_collective` (prepare and its broadcast, replica detection, this rank's
    write_rank, the gather of the reports, commit, the outcome's broadcast) under the Fabric.
    Rank 0's `write_rank` (the seam `save_collective` calls) first writes every other rank's
    shard into the same directory, with the replicated set replica detection gave (what each
    rank's own `save_collective` passes its write_rank), then rank 0's: their records are what the
    gather hands rank 0. `per_node` > 0: the per-node layout with that many ranks per node
    (bench_nodefile). The ranks are stamped (bench_stamp) unless `exact` or per-node: then each
    runs write_rank. `drop`: the stamped ranks' files are removed once written, but `keep`'s
    (the ranks whose restore plans are measured: each is checked against its stamp too)."""
    mesh = fake_world(world)
    group = Group(dist.group.WORLD, 0, world)
    template = payload_of(STEP, rank_state(model, mesh, world, 0), {"loss": 1.0}, None)
    fabric = Fabric(world)
    with fabric.installed():  # uncounted: the set the measured save's detection gives (checked below)
        replicated = replicated_across(group, template.tensors, template.skeleton.get("dtensors"))
    fabric = Fabric(world)
    out: dict[str, Any] = {"model": model, "ranks": world, "layout": f"per-node/{per_node}" if per_node else "per-rank",
                           "emulation": "exact" if exact or per_node else "stamped", "replicated": len(replicated),
                           "plain_tensors": sum(1 for n, _ in template.tensors
                                                if n not in (template.skeleton.get("dtensors") or {}))}
    sparse_node = bench_nodefile.SparseNode(_nbytes, _owns_memory, zero_blocks, zero_digests)
    layout = sparse_node.installed() if per_node else contextlib.nullcontext()
    sparse = SparseShards()
    stamper = None
    if out["emulation"] == "stamped":
        t0 = time.perf_counter()
        stamper = bench_stamp.Stamper(template, world, STEP, lambda rank, offsets: peer_payload(
            template, model, world, rank, offsets), sparse, root.with_name(root.name + ".stamps"), drop, replicated,
            keep)
        out["stamp_groups"] = len(stamper.groups)
        out["stamp_build_s"] = time.perf_counter() - t0
    real_write_rank = commit.write_rank
    clock: dict[str, float] = {}

    def every_rank_writes(root_: Path, step: int, group_: Group, skeleton: dict[str, Any], tensors: list[Any],
                          replicated_: set[str] | None = None, *, into: str) -> WriteReport:
        if set(replicated_ or ()) != replicated:
            raise SystemExit("bench_scale: the save's replica detection differs from the harness's")
        commit.write_rank = real_write_rank  # type: ignore[assignment]
        try:
            t0 = time.perf_counter()
            reports = [WriteReport.from_json(r) for r in stamper.save(root, into)] if stamper else []
            node = max(per_node, 1)
            for first in range(0, world if stamper is None else 0, node):  # every rank writes: what it then sends
                payloads = [(skeleton, tensors) if rank == 0 else peer_payload(template, model, world, rank)
                            for rank in range(first, min(first + node, world))]
                sizes = [sparse_node.size(first + i, *p) for i, p in enumerate(payloads)] if per_node else []
                for i, (skel, tens) in enumerate(payloads):
                    if per_node:
                        bench_nodefile.use_link(bench_nodefile.SequentialLink(i, first, sizes))
                    reports.append(real_write_rank(root, STEP, Group(None, first + i, world), skel, tens,
                                                   replicated, into=into))
        finally:
            commit.write_rank = every_rank_writes  # type: ignore[assignment]
        out["emulate_ranks_s"] = time.perf_counter() - t0  # no collective ran meanwhile: the bytes count on
        # What each rank sends rank 0: its fixed-size record (train/saving.py), by Group.gather_json.
        # Each rank encodes its own: not rank 0's time (kept apart as peer_records_cpu_s)
        cpu = time.process_time()
        fabric.peers = [json.dumps(r.record(), separators=(",", ":")).encode() for r in reports]
        out["peer_records_cpu_s"] = time.process_time() - cpu
        clock["wall"], clock["cpu"] = time.perf_counter(), time.process_time()
        return reports[0]

    with Fabric(world).installed():  # uncounted: the lease a Checkpointer takes once, before its first save
        key = claim_root(group, root, None, saving=True)
    commit.write_rank = every_rank_writes  # type: ignore[assignment]
    try:
        with fabric.installed(), sparse.installed(), layout, ops.counting() as counts:
            # Checkpointer._save_now: the root's lease checked by rank 0 (its verdict broadcast), then the save
            claim_root(group, root, key, saving=True)
            result = save_collective(group, root, STEP, template, replace_if_changed=False)
            # from rank 0's report to "saved": the gather of the records, commit, the outcome's broadcast
            out["commit_wall_s"] = time.perf_counter() - clock.get("wall", time.perf_counter())
            out["commit_cpu_s"] = time.process_time() - clock.get("cpu", time.process_time())
    finally:
        commit.write_rank = real_write_rank  # type: ignore[assignment]
        fabric.peers = None
        claims.unclaim(key)  # as Checkpointer.close: its heartbeat stops before the root is removed
    outcome = result.outcome.to_json() if result.outcome is not None else {"ok": False, "error": "skipped"}
    out.update(saved=bool(outcome.get("ok")), error=outcome.get("error"), save_ops=dict(counts),
               save_ops_total=Ops.total(counts), sent=dict(fabric.sent), received=dict(fabric.received),
               collectives=dict(fabric.calls), received_by_collective=dict(fabric.by_collective), calls=fabric.log)
    manifest = root / step_dir_name(STEP) / MANIFEST
    out["manifest_bytes"] = manifest.stat().st_size if manifest.exists() else _refused_size(outcome.get("error"))
    return out


def _refused_size(error: str | None) -> int | None:
    """The manifest's size from a refusal's one line ("... would be N bytes ..."), if it says."""
    import re

    m = re.search(r"(\d+)[- ]bytes?", error or "")
    return int(m.group(1)) if m else None


# -- the restore plan (one rank) ------------------------------------------------------------------

def calls_made(fn: Callable[[], Any]) -> int:
    """The Python-level calls `fn` makes (sys.setprofile's "call" and "c_call": every function,
    method and builtin, a JSON hook called from C included), not timed: the plan's work, which must
    not grow with W (tests/test_bench_scale.py). `fn`'s result is closed if it is a Part."""
    made = 0

    def count(frame: Any, event: str, arg: Any) -> None:
        nonlocal made
        if event in ("call", "c_call"):
            made += 1

    sys.setprofile(count)
    try:
        got = fn()
    finally:
        sys.setprofile(None)
    if isinstance(got, restoreplan.Part):
        got.opened.close()
    return made


def planned_part(rank: int, world: int, chosen: messages.RestoreChoice, sent: bytes, state: Any, live: Any) -> Any:
    """What `restoreload.load_choice` plans on `rank` (but 0): the manifest from the bytes rank 0
    sent, `plan_part`, then the exchange plan. Returns the plan (a Part, or the Failure)."""
    with restoreplan.gc_paused():
        planned = restoreplan.with_manifest(chosen, sent)
        result = restoreplan.plan_part(rank, planned, state, live, True)
        restoreload.exchange_plan(Group(None, rank, world), planned, result)
    return result


def other_rank(world: int) -> int:
    """The non-zero rank whose restore plan is measured: one in the middle of the world, whose
    own shard (at the same W; its box's at a reshard) is not shard 0."""
    return min(world - 1, world // 2 + 1)


def plan(model: str, saved_world: int, world: int, root: Path, ops: Ops, memory: bool = True,
         read: bool = False, repeats: int = 1) -> dict[str, Any]:
    """A `world`-rank job restoring the `saved_world`-rank step under `root`: rank 0's `pick` and
    its plan, and the plan of a rank that is not 0, at its own coordinate (`other_rank`: its own
    DTensor pieces and shard) with the choice and the manifest's bytes as they arrive by broadcast
    (`other_*`: it parses those bytes; `restoreload.share_manifest` sends rank 0's read unchanged),
    each timed, counted and, in a second pass, its peak Python heap. A plan is what
    `restoreload.load_choice` runs on every rank: `restoreplan.plan_part`, then
    `restoreload.exchange_plan` (a reshard's exchange plan; `*_exchange_s`, None at the same W).
    With `read`, then rank 0's `read_part` too: the bytes of its box (zeros from the sparse
    files) read and checked against their digests, into real zero tensors. `repeats`: the other
    rank's plan is made that many times, its median reported (`other_plan_runs`: each)."""
    mesh = fake_world(world)
    state = rank_state(model, mesh, world, 0, zeros=read)
    live = flatten_live(state)
    out: dict[str, Any] = {"from": saved_world, "to": world}

    def timed_plan(key: str, rank: int, chosen: messages.RestoreChoice, st: Any, lv: Any, sent: bytes = b"") -> Any:
        # as restoreload.load_choice: the GC paused until the restore drops what the plan made (here
        # the clock stops first: the collection at the end walks what the restore keeps)
        with ops.counting() as counts, restoreplan.gc_paused():
            t, c = time.perf_counter(), time.process_time()  # a rank but 0: parse the bytes rank 0 sent, then plan
            planned = restoreplan.with_manifest(chosen, sent)
            result = restoreplan.plan_part(rank, planned, st, lv, True)
            x = time.perf_counter()
            xplan = restoreload.exchange_plan(Group(None, rank, world), planned, result)
            out[f"{key}_s"], out[f"{key}_cpu_s"] = time.perf_counter() - t, time.process_time() - c
            out[f"{key}_exchange_s"] = time.perf_counter() - x if xplan is not None else None
            out[f"{key}_ops"] = Ops.total(counts)
        return result

    with Fabric(world).installed():
        with ops.counting() as counts:
            t, c = time.perf_counter(), time.process_time()
            choice = restorechoice.pick(root, None, False, set(), False, None)
            out["pick_s"], out["pick_cpu_s"] = time.perf_counter() - t, time.process_time() - c
            out["pick_ops"] = Ops.total(counts)
        if not isinstance(choice, messages.RestoreChoice):
            return {**out, "error": str(getattr(choice, "message", choice))}
        part = timed_plan("plan", 0, choice, state, live)
        if isinstance(part, messages.Failure):
            return {**out, "error": part.message}
        wire = messages.pick_from_json(json.loads(json.dumps(messages.pick_to_json(choice))))
        sent = choice.manifest.raw_bytes or b""  # what share_manifest broadcasts
        out["choice_bytes"] = len(json.dumps(messages.pick_to_json(choice), separators=(",", ":")))
        out["manifest_sent_bytes"] = len(sent)
        if read:
            with ops.counting() as counts:
                t = time.perf_counter()
                got = restoreplan.read_part(0, choice, part, list(state), live, True)
                out["read_s"] = time.perf_counter() - t
                out["read_ops"] = Ops.total(counts)
            out["read_bytes"], out["needed_bytes"] = got.read, got.needed
            if got.failure is not None:
                return {**out, "error": got.failure.message}
        part.opened.close()
        if memory:
            tracemalloc.start()
            choice = restorechoice.pick(root, None, False, set(), False, None)
            out["pick_peak_bytes"] = tracemalloc.get_traced_memory()[1]
            choice.manifest.raw_bytes = None  # restoreload.share_manifest: sent, and dropped before rank 0 plans
            tracemalloc.reset_peak()
            restoreplan.plan_part(0, choice, state, live, True).opened.close()
            out["plan_peak_bytes"] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
    rank = out["other_rank"] = other_rank(world)
    state = rank_state(model, fake_world(world, rank), world, rank)
    live = flatten_live(state)
    with Fabric(world).installed():
        runs = []
        for _ in range(max(repeats, 1)):  # on a loaded machine: the median of a few plans
            other = timed_plan("other_plan", rank, wire, state, live, sent)
            if isinstance(other, messages.Failure):
                return {**out, "error": other.message}
            other.opened.close()
            runs.append((out["other_plan_s"], out["other_plan_cpu_s"], out["other_plan_exchange_s"]))
        out["other_plan_runs"] = runs
        out["other_plan_calls"] = calls_made(lambda: planned_part(rank, world, wire, sent, state, live))
        out["other_plan_s"], out["other_plan_cpu_s"] = (statistics.median(r[i] for r in runs) for i in (0, 1))
        if runs[0][2] is not None:
            out["other_plan_exchange_s"] = statistics.median(r[2] for r in runs)
        # + W x read_ops with --read (rank 0's read standing for every rank's)
        out["restore_ops_total"] = out["pick_ops"] + out["plan_ops"] + (world - 1) * out["other_plan_ops"]
        if read:
            out["restore_ops_total"] += world * out["read_ops"]
        if memory:
            tracemalloc.start()
            received = bytes(memoryview(sent))  # what the broadcast hands that rank: dropped once parsed
            with restoreplan.gc_paused():
                planned = restoreplan.with_manifest(wire, received)
                del received
                restoreplan.plan_part(rank, planned, state, live, True).opened.close()
            out["other_plan_peak_bytes"] = tracemalloc.get_traced_memory()[1]
            del planned
            tracemalloc.stop()
    return out


# -- the driver -----------------------------------------------------------------------------------

def measure(model: str, world: int, reshard_to: int | None, workdir: Path, memory: bool = True,
            read: bool = False, per_node: int = 0, exact: bool = False, digest: bool = False,
            drop: bool = False, repeats: int = 1) -> dict[str, Any]:
    """One (model, W) point: the save, then the same-W restore plan and the reshard's. `digest`:
    the save runs with time.time frozen (the manifest's and marker's times) and the row gets the
    step's `step_digest` (bench_stamp), to compare the stamped emulation with `exact`."""
    from unittest import mock

    root = Path(tempfile.mkdtemp(prefix=f"scale-{model}-{world}-", dir=workdir))
    ops = Ops()
    if digest:  # rank 0's RNG state is saved (the library's own): the same in every run
        torch.manual_seed(0)
        random.seed(0)
        numpy.random.seed(0)
    try:
        with mock.patch("time.time", return_value=1.0e9) if digest else contextlib.nullcontext():
            keep = frozenset(other_rank(w) for w in (world, reshard_to) if w)  # the plans measured read these
            row = save_rank0(model, world, root, ops, per_node, exact, drop, keep)
        if digest and row["saved"]:
            row["step_digest"] = bench_stamp.step_digest(root / step_dir_name(STEP))
        if row["saved"]:
            row["same"] = plan(model, world, world, root, ops, memory, read, repeats)
            if reshard_to:
                row["reshard"] = plan(model, world, reshard_to, root, ops, memory, read, repeats)
        return row
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


def _exchange(seconds: float | None) -> str:
    return "" if seconds is None else f", of which the exchange plan {seconds * 1e3:.1f} ms"


def line(r: dict[str, Any]) -> str:
    if r.get("skipped"):
        return f"{r['model']:>4s} {r['ranks']:6d} ranks: not run ({r['skipped']})"
    ops = r["save_ops"]
    s = (f"{r['model']:>4s} {r['ranks']:6d} ranks {r.get('layout', 'per-rank')}: creates {ops.get('create', 0):,} "
         f"fsyncs {ops.get('fsync', 0):,} per save; manifest {mib(r['manifest_bytes'])}"
         f"{'' if r['saved'] else ' REFUSED: ' + str(r['error'])[:90]}; commit (rank 0) "
         f"{r['commit_wall_s']:.3f} s wall {r['commit_cpu_s']:.3f} s cpu; save recv rank0 "
         f"{mib(r['received']['rank0'])}, a non-zero rank {r['received']['other']:,} B "
         f"({', '.join(f'{k} {v:,}' for k, v in sorted(r.get('received_by_collective', {}).items()))}; "
         f"{r.get('replicated', 0)} of {r.get('plain_tensors', 0)} plain tensors replicated), sent "
         f"{r['sent']['other']} B; save ops {r['save_ops_total']:,} ({r['save_ops'].get('fsyncdir', 0):,} dir fsyncs); "
         f"{r.get('emulation', 'exact')} emulation of the ranks {r.get('emulate_ranks_s', 0):.1f} s"
         f"{' digest ' + r['step_digest'] if 'step_digest' in r else ''}")
    for key in ("same", "reshard"):
        p = r.get(key)
        if p is None:
            continue
        if "error" in p:
            s += f"\n      restore {p['from']}->{p['to']}: {p['error'][:100]}"
            continue
        s += (f"\n      restore {p['from']}->{p['to']}: pick (rank 0) {p['pick_s'] * 1e3:.1f} ms "
              f"({p['pick_cpu_s'] * 1e3:.1f} cpu), plan rank 0 {p['plan_s'] * 1e3:.1f} ms "
              f"({p['plan_cpu_s'] * 1e3:.1f} cpu), plan rank {p.get('other_rank', '?')} {p['other_plan_s'] * 1e3:.1f} ms "
              f"({p['other_plan_cpu_s'] * 1e3:.1f} cpu{_exchange(p.get('other_plan_exchange_s'))}, "
              f"{p.get('other_plan_calls', 0):,} calls), peak heap pick {mib(p.get('pick_peak_bytes'))} plan "
              f"{mib(p.get('plan_peak_bytes'))} other {mib(p.get('other_plan_peak_bytes'))}; choice broadcast "
              f"{p['choice_bytes']} B, manifest broadcast {mib(p.get('manifest_sent_bytes'))}; ops pick {p['pick_ops']:,} + plan {p['plan_ops']} + (W-1) x "
              f"{p['other_plan_ops']} = {p['restore_ops_total']:,} ({p['restore_ops_total'] / p['to']:.2f} per rank)")
        if "read_s" in p:
            s += f"; read {mib(p['read_bytes'])} in {p['read_s']:.2f} s, {p['read_ops']} ops"
    return s


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--ranks", default="8,64,512,4096,16384", help="world sizes, comma separated")
    ap.add_argument("--models", default="7B,70B,405B", help="of: " + ", ".join(MODELS))
    ap.add_argument("--reshard", default="64:48,16384:12288",
                    help="FROM:TO,...: also plan rank 0's restore of the FROM-rank step on TO ranks ('' for none)")
    ap.add_argument("--max-manifest-mib", type=float, default=256.0,
                    help="do not build a manifest predicted over this size (extrapolated from the last one)")
    ap.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass (peak heap of the plan)")
    ap.add_argument("--read", action="store_true",
                    help="also read rank 0's box (zeros, checked against digests): memory = its bytes per rank")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the sparse checkpoints are written")
    ap.add_argument("--json-out", default=None, help="also write every figure there as JSON")
    ap.add_argument("--layout", default="per-rank",
                    help="per-rank, or per-node:N (one file per node of N ranks, checkpoint/nodefile.py), "
                         "or both: per-rank,per-node:8 (each (model, W) saved once per layout)")
    ap.add_argument("--exact-emulation", action="store_true",
                    help="run the real write_rank for every rank (slow) instead of stamping the ranks whose "
                         "local shapes repeat (scripts/bench_stamp.py; same files, checked on every run)")
    ap.add_argument("--drop-stamped", action="store_true",
                    help="remove each stamped rank's shard and index once written (uncounted): ~2 MB a rank "
                         "at 405B, 32 GB at 16,384 ranks; no measured restore reads them")
    ap.add_argument("--step-digest", action="store_true",
                    help="freeze time.time during each save and print a digest of the step's files "
                         "(to compare the stamped emulation with --exact-emulation)")
    ap.add_argument("--plan-repeats", type=int, default=1,
                    help="make the non-zero rank's plan this many times and report the median (a loaded machine)")
    ap.add_argument("--peer", choices=("", "dcp"), default="",
                    help="also measure torch.distributed.checkpoint the same way at each point (bench_scale_dcp.py)")
    args = ap.parse_args(argv)
    try:
        worlds = [int(x) for x in args.ranks.split(",")]
        reshard = {int(a): int(b) for a, _, b in (p.partition(":") for p in args.reshard.split(",") if p)}
    except ValueError:
        ap.error(f"--ranks {args.ranks!r} / --reshard {args.reshard!r}: expected integers (8,64 and 16384:12288)")
    models = args.models.split(",")
    try:
        layouts = [0 if x == "per-rank" else int(x.removeprefix("per-node:")) for x in args.layout.split(",")]
    except ValueError:
        layouts = [-1]
    if any(n < 0 for n in layouts):
        ap.error(f"--layout {args.layout!r}: expected per-rank and/or per-node:N (N ranks per node)")
    if any(w < 2 for w in worlds) or any(m not in MODELS for m in models) or any(v < 1 for v in reshard.values()):
        ap.error(f"--ranks must be at least 2 and --models among {', '.join(MODELS)}")
    try:  # a --dir that does not exist yet is made (as --json-out's file is)
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        ap.error(f"--dir {args.dir}: {exc.strerror}")
    import logging

    logging.getLogger("slurmresume").setLevel(logging.ERROR)
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs (shared, loaded)", flush=True)
    rows = []
    for model in models:
        last: tuple[int, int] | None = None  # (world, manifest bytes)
        for world in worlds:
            predicted = last[1] * world / last[0] if last and last[1] else None
            if predicted is not None and predicted > args.max_manifest_mib * 2**20:
                over = " (over this version's read cap: the save would refuse)" if predicted > MAX_MANIFEST else ""
                row: dict[str, Any] = {"model": model, "ranks": world, "predicted_manifest_bytes": predicted,
                                       "skipped": f"manifest predicted {mib(predicted)}{over}"}
            else:
                for per_node in layouts:
                    to = reshard.get(world)
                    row = measure(model, world, to, Path(args.dir), memory=not args.no_memory, read=args.read,
                                  per_node=per_node, exact=args.exact_emulation, digest=args.step_digest,
                                  drop=args.drop_stamped, repeats=args.plan_repeats)
                    if row.get("manifest_bytes"):
                        last = (world, row["manifest_bytes"])
                    rows.append(row)
                    print(line(row), flush=True)
                if args.peer == "dcp":  # once per point: DCP has no layouts of ours
                    import bench_scale_dcp

                    row["dcp"] = bench_scale_dcp.beside(model, world, reshard.get(world), Path(args.dir),
                                                        not args.no_memory)
                    print(bench_scale_dcp.line(row["dcp"]), flush=True)
                continue
            rows.append(row)
            print(line(row), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                   "rows": rows}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

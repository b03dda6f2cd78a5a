"""The per-node layout (opt-in): the ranks of one node write disjoint ranges of one file.

On a parallel file system every create is a metadata-server operation, and W ranks creating W
shards and W index files at the same moment queue on it. With `SLURMRESUME_LAYOUT=per-node` a
step holds one data file per node instead of two files per rank:

    step_N/node-00000.bin     ranks 0..L-1, each its own range: its safetensors bytes, then its
                              tensor index (`rankindex`), padded with blanks to the size agreed
    step_N/node-00008.bin     ...named by the node's first rank

A rank's manifest entry names its shard as "node-00000.bin@OFFSET" (the shard's bytes and xxh3
as before) and its index as "node-00000.bin@OFFSET2": every reader (restore at the same W or
resharded, verify, inspect, export) reads a rank's bytes from its range (`shardread.split_locator`,
`rankindex.read_index`). Format 1 and per-rank format-2 steps are read as before. Creates per
save: W / L + 5 instead of 2 W + 5; file fsyncs W / L + 3 instead of 2 W + 3 (the rest are the
save's own note, manifest, marker and root lock: docs/scaling.md, "One file per node").

The protocol, on the ranks of one node (L = LOCAL_WORLD_SIZE; torchrun numbers a node's ranks
contiguously: [RANK - LOCAL_RANK, + L)); no rank outside the node takes part:
  1. every rank plans its shard (header and size are known before a byte is written) and its
     index (each block digest is 16 hex digits: its length is known too; the offset in its
     "file" field is reserved at 19 digits and the JSON padded);
  2. one node-local all-gather of [size, host] (a gloo subgroup of the node's ranks, made once
     per process, `use_local_synchronization`, and reused by later Checkpointers): each rank's
     range is the sum of the sizes before it, each range starting on a 4 KiB boundary (O_DIRECT
     writes aligned blocks);
  3. the node's first rank creates the file (O_EXCL: the save's private directory) and sizes it;
     node barrier;
  4. every rank writes its range (the write path `calibrate` picks for the file system): its
     shard, then its index; no rank fsyncs; node barrier;
  5. the first rank fsyncs the file once. One fsync of an inode flushes every dirty page of it on
     this host, whichever process wrote them, so one fsync per node replaces L. When the ranks
     turn out not to share a host (a launch that numbers ranks otherwise) each rank fsyncs
     its own writes instead: the leader's fsync would not reach another client's cache.
A rank that fails still reaches both barriers (its error travels in its record to rank 0, which
then commits nothing), so no rank of the node waits forever on it. A rank killed mid-write
leaves its node waiting at a barrier until the launcher ends the job; nothing is committed.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import xxhash

from ..errors import CheckpointError, ConfigError
from . import fsio
from .calibrate import open_sink
from .layout import node_file_name
from .rankindex import index_bytes, placed
from .shard import (
    ITEMSIZE,
    VERIFY_BLOCK,
    ShardPlan,
    WrittenShard,
    plan_shard,
    stream_shard,
    written,
)
from .writer import ALIGN

ENV = "SLURMRESUME_LAYOUT"
LAYOUTS = ("per-rank", "per-node")


def layout_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """The layout this save writes: "per-rank" (the default) or "per-node"."""
    value = env.get(ENV, "").strip() or LAYOUTS[0]
    if value not in LAYOUTS:
        raise ConfigError(f"{ENV}={value!r} is not a layout; valid: {', '.join(LAYOUTS)} (default {LAYOUTS[0]})")
    return value


def check_layout(mirrored: bool) -> str:
    """Every rank, when a Checkpointer starts: the layout, or one ConfigError line (a bad value,
    or the per-node layout with a mirror, which this version's mirror does not copy)."""
    layout = layout_from_env()
    if layout == "per-node" and mirrored:
        raise ConfigError(f"{ENV}=per-node cannot be mirrored by this version (the mirror copies a step file by "
                          f"file); unset {ENV} or the mirror")
    return layout


def node_ranks(rank: int, world: int, local_rank: int, local_world: int) -> range:
    """Pure: the global ranks of `rank`'s node. torchrun gives each node's agent a contiguous
    block of global ranks (its workers are rank - LOCAL_RANK ... + LOCAL_WORLD_SIZE - 1), also when
    nodes run different numbers of workers. Anything inconsistent (no torchrun variables) makes
    the rank its own node: correct, only not fewer files."""
    first = rank - local_rank
    if not (0 <= local_rank < local_world and first >= 0 and first + local_world <= world):
        return range(rank, rank + 1)
    return range(first, first + local_world)


def ranges(sizes: list[int], align: int = ALIGN) -> tuple[list[int], int]:
    """Pure: each rank's offset in the node file (aligned) and the file's size."""
    offsets, at = [], 0
    for size in sizes:
        offsets.append(at)
        at += -(-size // align) * align
    return offsets, at


class NodeLink(Protocol):
    index: int  # this rank's place among its node's ranks (0: the node's first rank, the leader)
    first: int  # the node's first global rank: names the file

    def exchange(self, values: list[int]) -> list[list[int]]: ...

    def barrier(self) -> None: ...


class GlooLink:
    """The node's ranks over a gloo subgroup of just them, kept on the save side `Group` (taken when
    the Checkpointer is made, `train/wiring.py`, else at its first save) and given back when the
    Group is destroyed: `collective.NodeGroups` reuses it. Collective among the node's ranks only."""

    def __init__(self, group: Any, ranks: range) -> None:
        self.index, self.first, self.size = group.rank - ranks.start, ranks.start, len(ranks)
        self.pg = getattr(group, "node_pg", None)
        if self.pg is None and self.size > 1:
            from .collective import NODE_GROUPS

            self.pg = NODE_GROUPS.take(list(ranks))
            group.node_pg = self.pg

    def exchange(self, values: list[int]) -> list[list[int]]:
        if self.size == 1:
            return [values]
        import torch
        import torch.distributed as dist

        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.pg)
        return [[int(v) for v in t.tolist()] for t in out]

    def barrier(self) -> None:
        if self.size > 1:
            self.exchange([0])


def link_for(group: Any) -> NodeLink:
    """The node link of this rank (a seam: the scale harness and tests hand their own)."""
    try:
        local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        local_rank, local_world = 0, 1
    return GlooLink(group, node_ranks(group.rank, group.world_size, local_rank, local_world))


def _host() -> int:
    return xxhash.xxh3_64_intdigest(socket.gethostname().encode()) & ((1 << 63) - 1)


def write_node_shard(directory: Path, link: NodeLink, rank: int, tensors: list[tuple[str, Any]],
                     metadata: dict[str, str], specs: dict[str, Any]) -> tuple[WrittenShard, dict[str, Any]]:
    """Every rank of a node, together: write this rank's shard, then its tensor index, into its
    range of the node file (the module's protocol). Returns the shard as written and what the
    manifest records of the index. Raises this rank's error only after both node barriers."""
    path = directory / node_file_name(link.first)
    error: BaseException | None = None
    plan, fd, reserved = None, -1, 0
    try:
        plan, reserved = planned(path, rank, tensors, metadata, specs)
    except BaseException as exc:
        error = exc
    host = _host()
    sizes = link.exchange([plan.bytes + reserved if plan is not None else -1, host])
    offsets, total = ranges([max(s, 0) for s, _ in sizes])
    same_host = all(h == host for _, h in sizes)
    if error is None and any(s < 0 for s, _ in sizes):
        error = OSError(f"another rank of node {path.name} could not plan its shard")
    if link.index == 0 and error is None:
        try:  # the save's private directory: nobody else creates this name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
            os.ftruncate(fd, total)
        except BaseException as exc:
            error = exc
    link.barrier()  # the file exists with its size (or the leader failed: the open below fails)
    base = offsets[link.index]
    sink, digest, own = None, "", {}
    if error is None and plan is not None:
        try:
            sink = open_sink(path, size_hint=plan.bytes, base=base, shared=True, sync=False)
            digest = stream_shard(sink, plan, path)
            own = _write_index(path, base + plan.bytes, reserved, rank, f"{path.name}@{base}", plan.index, specs,
                               sync=not same_host)
        except BaseException as exc:
            if sink is not None:
                sink.abort()
            error = exc
    link.barrier()  # every range of the node is written
    try:
        if fd >= 0 and error is None and same_host:
            fsio.fsync_fd(fd, "shard", path)  # one fsync for the node's L ranges
    except BaseException as exc:
        error = exc
    finally:
        if fd >= 0:
            os.close(fd)
    if error is not None:
        fsio.note_failure(error, path, plan.bytes if plan is not None else None)
        raise error
    assert plan is not None and sink is not None
    shard = written(f"{path.name}@{base}", plan, sink, digest)
    return replace(shard, tensors=placed(shard.tensors, specs)), own


def planned(path: Path, rank: int, tensors: list[tuple[str, Any]], metadata: dict[str, str],
            specs: dict[str, Any]) -> tuple[ShardPlan, int]:
    """The rank's shard plan and the bytes reserved for its index: its range is their sum."""
    plan = plan_shard(path, tensors, metadata)
    return plan, len(_index(rank, f"{path.name}@{'9' * 19}", plan.index, specs, placeholder=True))


def _index(rank: int, file: str, index: dict[str, Any], specs: dict[str, Any], placeholder: bool = False) -> bytes:
    """The rank's index file's bytes; with `placeholder`, before the digests exist: each digest
    is 16 hex digits, so the length is the final one (file: the longest locator)."""
    if placeholder:
        index = {n: {**e, "xxh3": ["0" * 16] * -(-_nbytes(e) // VERIFY_BLOCK)} for n, e in index.items()}
    return index_bytes(rank, file, placed(index, specs))


def _nbytes(entry: dict[str, Any]) -> int:
    n = ITEMSIZE[entry["dtype"]]
    for d in entry["shape"]:
        n *= d
    return n


def _write_index(path: Path, at: int, reserved: int, rank: int, file: str, index: dict[str, Any],
                 specs: dict[str, Any], sync: bool) -> dict[str, Any]:
    """The index, padded with spaces to the `reserved` bytes agreed, right after the shard."""
    raw = _index(rank, file, index, specs)
    if len(raw) > reserved:
        raise OSError(f"rank {rank}'s tensor index grew past the {reserved} bytes reserved for it in {path}")
    raw += b" " * (reserved - len(raw))  # JSON allows trailing blanks; the digest covers them
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        fsio.pwrite_all(fd, raw, at, "index", path)
        if sync:
            fsio.fsync_fd(fd, "shard", path)
    finally:
        os.close(fd)
    return {"index": f"{path.name}@{at}", "index_bytes": reserved, "index_xxh3": xxhash.xxh3_64_hexdigest(raw)}


def refuse_mirror(files: list[dict[str, Any]], where: str) -> None:
    """The mirror copies a step file by file; this version does not copy node files' ranges:
    one clear line instead of a bucket copy that could not be restored."""
    if any("@" in s["file"] for s in files):
        raise CheckpointError(f"{where} uses the per-node layout ({ENV}=per-node): this version's mirror does not "
                              f"copy it; save with {ENV}=per-rank (the default) to mirror checkpoints")

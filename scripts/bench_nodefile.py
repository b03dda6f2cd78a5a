"""bench_scale's per-node layout (`--layout per-node`): the node file's writes made sparse, as
bench_scale.SparseShards makes a rank's own file, and the node's ranks emulated one after the
other in this process.

`checkpoint.nodefile.write_node_shard` runs for real (its create, its node barriers, its one
fsync per node); what is replaced, at the module attributes it calls:
- `plan_shard`: the real header (`shard.header_with_digests`: its fine and block digests those
  bench_scale.zero_digests works out from the shapes, the pieces here being meta tensors or one
  float expanded, with no bytes to hash);
- `open_sink` + `stream_shard`: the header and the bytes of tensors that own memory (the library's
  RNG) are pwritten into the rank's range, the rest stays a hole (zeros), its block digests those
  of zeros; the same open (no create) and, where the protocol says so, fsync;
- the node link: `SequentialLink` answers the exchange with the sizes planned beforehand for the
  node's ranks (each rank is run to completion before the next: its barriers have nobody to wait for).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import xxhash

from slurmresume.checkpoint import fsio, nodefile, shardread
from slurmresume.checkpoint import shard as shard_mod
from slurmresume.checkpoint.jsonenc import dumps


class SequentialLink:
    def __init__(self, index: int, first: int, sizes: list[int]) -> None:
        self.index, self.first, self.sizes = index, first, sizes

    def exchange(self, values: list[int]) -> list[list[int]]:
        return [[s, values[1]] for s in self.sizes]  # one host: the node's leader fsyncs

    def barrier(self) -> None:
        pass


class _Sink:
    def __init__(self, path: Path, base: int, sync: bool) -> None:
        self.path, self.base, self.sync = path, base, sync
        self.fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
        self.total, self.strategy = 0, "sparse"

    def timing(self) -> dict[str, float]:
        return {}

    def abort(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SparseNode:
    """Installs the replacements above; `sizes(...)` plans a node's ranks beforehand."""

    def __init__(self, nbytes: Callable[[Any], int], owns_memory: Callable[[Any], bool],
                 zero_blocks: Callable[[int], list[str]], digests: Callable[..., Any] | None = None) -> None:
        self.nbytes, self.owns_memory, self.zero_blocks, self.digests = nbytes, owns_memory, zero_blocks, digests

    def plan(self, final: Path, tensors: list[tuple[str, Any]], metadata: dict[str, str]) -> Any:
        tensors = shard_mod.order_for_alignment(tensors)
        fine, blocks = self.digests(tensors, metadata) if self.digests is not None else ({}, {})
        header, index, _ = shard_mod.header_with_digests(tensors, metadata, fine, blocks)
        return shard_mod.ShardPlan(header, index, tensors, set(), len(header) + sum(self.nbytes(t) for _, t in tensors))

    def size(self, rank: int, skeleton: dict[str, Any], tensors: list[tuple[str, Any]]) -> int:
        """The range write_rank will ask for this rank (shard and index; the same metadata)."""
        metadata = {shard_mod.SKELETON_KEY: dumps(skeleton), "format": "pt"}
        plan, reserved = nodefile.planned(Path("node.bin"), rank, tensors, metadata, skeleton.get("dtensors") or {})
        return int(plan.bytes) + reserved

    def stream(self, sink: _Sink, plan: Any, label: Path) -> str:
        try:
            os.pwrite(sink.fd, plan.header, sink.base)
            at = len(plan.header)
            for name, t in plan.tensors:
                n = self.nbytes(t)
                if self.owns_memory(t):
                    raw = bytes(shardread.byte_view(t.detach().contiguous()))
                    os.pwrite(sink.fd, raw, sink.base + at)
                    block = shard_mod.VERIFY_BLOCK
                    plan.index[name]["xxh3"] = [xxhash.xxh3_64_hexdigest(raw[i:i + block]) for i in range(0, n, block)]
                else:
                    plan.index[name]["xxh3"] = self.zero_blocks(n)
                at += n
            sink.total = at
            if sink.sync:
                fsio.fsync_fd(sink.fd, "shard", sink.path)
        finally:
            sink.abort()
        return "0" * 16

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = {k: getattr(nodefile, k) for k in ("plan_shard", "open_sink", "stream_shard", "link_for")}
        nodefile.plan_shard = self.plan  # type: ignore[assignment]
        nodefile.open_sink = lambda path, size_hint=0, *, base, shared, sync: _Sink(path, base, sync)  # type: ignore[assignment]
        nodefile.stream_shard = self.stream  # type: ignore[assignment]
        before = os.environ.get(nodefile.ENV)
        os.environ[nodefile.ENV] = "per-node"
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(nodefile, k, v)
            if before is None:
                os.environ.pop(nodefile.ENV, None)
            else:
                os.environ[nodefile.ENV] = before


def use_link(link: SequentialLink) -> None:
    nodefile.link_for = lambda group: link  # type: ignore[assignment]

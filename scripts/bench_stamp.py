"""bench_scale's fast emulation of W ranks' saves: ranks whose local shapes repeat are "stamped".

Under FSDP2's Shard(0) the ranks of a W-rank job fall into a handful of groups whose local
shapes are all the same (the ranks past a tensor's last row hold none of it). Within a group,
what a rank writes differs only in its rank, its file's name and its pieces' global offsets. So,
per group:

1. the real `commit.write_rank` (with bench_scale's sparse shard writer) writes one exemplar rank
   into a scratch directory, with every global offset set to a sentinel number (`SENTINEL` + the
   index of its dim-0 length): the template is that rank's safetensors header and index file,
   as text cut at the sentinels and at its rank's `"rank":R,"file":"..."`;
2. each rank of the group is that text with its own numbers in place, hashed, and written with
   the calls the real writer makes (create, write, ftruncate, fsync, the index's durable write,
   rename): the metadata operations count the same at the os and fsio seams.

Checked on every run: rank 0 (the real DTensor payload), ranks 1-3 and the first and last rank of
every group go through the real `write_rank`, and each of their reports (sizes, header and index
digests, everything the manifest records) and shard headers is compared with its stamp; a
difference stops the run (`--exact-emulation` is the rank-by-rank path). A group whose exemplar
cannot be cut (its save failed, or its text does not hold the pieces expected) is run rank by
rank. Only the per-rank layout is stamped.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash
from model_shapes import chunk0

from slurmresume.checkpoint import commit, fsio
from slurmresume.checkpoint.collective import Group
from slurmresume.checkpoint.layout import index_name, saving_dir_name, shard_name

# 19 digits: longer than any shape, size or offset of these models and than a 16-hex-digit digest,
# so a template's text holds one only where a global offset was written
SENTINEL = 8_000_000_000_000_000_000
_UNLINK = os.unlink  # taken before bench_scale's Ops wraps os.unlink: --drop-stamped's unlinks are not counted
RANK = "rank"  # the slot of `"rank":R,"file":"<R's shard>"`

Payload = tuple[dict[str, Any], list[Any]]


def rank_text(rank: int, world: int) -> str:
    return f'"rank":{rank},"file":"{shard_name(rank, world)}"'


def cut(text: str, slots: dict[str, str]) -> list[str]:
    """`text` as [literal, slot, literal, slot, ..., literal]: each occurrence of a key of `slots`
    (a digit run only where no digit is beside it) replaced by its slot name."""
    alternatives = "|".join(rf"(?<!\d){re.escape(k)}(?!\d)" if k.isdigit() else re.escape(k) for k in slots)
    parts = re.split(f"({alternatives})", text)
    return [slots[p] if i % 2 else p for i, p in enumerate(parts)]


def fill(parts: list[str], values: dict[str, str]) -> str:
    out = parts[:]
    out[1::2] = [values[k] for k in parts[1::2]]
    return "".join(out)


@dataclass(frozen=True)
class Stamp:
    """One group's template (see the module docstring)."""

    header: list[str]  # the header's JSON (no length, no padding), cut
    index: list[str]  # the index file, cut
    data: int  # bytes of tensor data after the header
    real: list[tuple[int, bytes]]  # (offset in the data, bytes) of the tensors that own memory
    report: dict[str, Any]  # the exemplar's report: every key the stamp does not replace

    def render(self, rank: int, world: int, offsets: list[int]) -> tuple[bytes, bytes, dict[str, Any]]:
        """Rank `rank`'s shard header, index file and report, as the real write_rank makes them."""
        values = {f"o{g}": str(o) for g, o in enumerate(offsets)}
        values[RANK] = rank_text(rank, world)
        raw = fill(self.header, values).encode()
        raw += b" " * (-len(raw) % 8)  # shard.build_header's padding
        header = struct.pack("<Q", len(raw)) + raw
        index = fill(self.index, values).encode()
        report = {**self.report, "rank": rank, "file": shard_name(rank, world), "bytes": len(header) + self.data,
                  "header_xxh3": xxhash.xxh3_64_hexdigest(header), "index": index_name(rank),
                  "index_bytes": len(index), "index_xxh3": xxhash.xxh3_64_hexdigest(index)}
        return header, index, report


class Stamper:
    """Builds the groups' templates (outside any counting) and then writes a whole save.

    `peer(rank, offsets)`: rank's (skeleton, tensors) as bench_scale emulates it, its pieces'
    global offsets taken from `offsets` (dim-0 length -> offset) when given. `sparse`: the
    installed shard writer, whose `last` holds (header, data bytes, [(data offset, bytes)]).
    `drop`: each stamped rank's shard and index are unlinked as soon as they are written, by this
    harness (uncounted): 405B at 16,384 ranks is ~2 MB of header and index per rank, 32 GB, and
    no measured restore reads a stamped rank's files (the ranks it reads are checked ranks).
    `replicated`: the save's replica detection's set, passed to every write_rank (as each rank's
    `save_collective` passes it). `keep`: more ranks to write and check as the checked ranks are
    (and so never drop)."""

    def __init__(self, template: Any, world: int, step: int, peer: Callable[..., Payload], sparse: Any,
                 scratch: Path, drop: bool = False, replicated: set[str] | None = None,
                 keep: frozenset[int] = frozenset()) -> None:
        self.template, self.world, self.step, self.peer, self.sparse = template, world, step, peer, sparse
        self.drop, self.replicated, self.keep = drop, set(replicated or ()), keep
        specs = template.skeleton.get("dtensors") or {}
        self.dims = sorted({int(sp["shape"][0]) for sp in specs.values()})
        self.groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(1, world):
            self.groups.setdefault(self.signature(rank), []).append(rank)
        self.stamps: dict[tuple[int, ...], Stamp | None] = {}
        try:
            with sparse.installed():
                for key, ranks in self.groups.items():
                    self.stamps[key] = self._exemplar(ranks[0], scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def signature(self, rank: int) -> tuple[int, ...]:
        return tuple(chunk0(d, self.world, rank)[1] for d in self.dims)

    def offsets(self, rank: int) -> list[int]:
        return [chunk0(d, self.world, rank)[0] for d in self.dims]

    def _exemplar(self, rank: int, scratch: Path) -> Stamp | None:
        sentinels = {d: SENTINEL + g for g, d in enumerate(self.dims)}
        skeleton, tensors = self.peer(rank, sentinels)
        report = commit.write_rank(scratch, self.step, Group(None, rank, self.world), skeleton, tensors,
                                   self.replicated, into=saving_dir_name(self.step, "0" * 16)).to_json()
        if report.get("error"):
            return None
        header, data, real = self.sparse.last
        index = (scratch / saving_dir_name(self.step, "0" * 16) / report["index"]).read_bytes()
        slots = {str(s): f"o{g}" for g, s in enumerate(sentinels.values())}
        head = header[8:].rstrip(b" ").decode("ascii")
        cut_header = cut(head, slots)
        cut_index = cut(index.decode("ascii"), {**slots, rank_text(rank, self.world): RANK})
        if cut_index[1::2].count(RANK) != 1 or RANK in cut_header[1::2] or len(cut_header) < 3:
            return None
        return Stamp(cut_header, cut_index, data, list(real), report)

    def checked_ranks(self) -> set[int]:
        """The ranks written by the real write_rank and compared with their stamps."""
        ends = {r for ranks in self.groups.values() for r in (ranks[0], ranks[-1])}
        return {0, *range(1, min(4, self.world)), *ends, *(r for r in self.keep if r < self.world)}

    def save(self, root: Path, into: str) -> list[dict[str, Any]]:
        """Every rank's report, in rank order (inside the caller's counting)."""
        checked = self.checked_ranks()
        d = root / into
        reports: dict[int, dict[str, Any]] = {}
        for rank in sorted(checked):  # first: a stamp that differs stops the run before the rest is written
            payload = (self.template.skeleton, self.template.tensors) if rank == 0 else self.peer(rank, None)
            reports[rank] = commit.write_rank(root, self.step, Group(None, rank, self.world), *payload,
                                              self.replicated, into=into).to_json()
            self._compare(rank, reports[rank])
        for key, ranks in self.groups.items():
            stamp = self.stamps[key]
            for rank in ranks:
                if rank in checked:
                    continue
                if stamp is None:
                    reports[rank] = commit.write_rank(root, self.step, Group(None, rank, self.world),
                                                      *self.peer(rank, None), self.replicated, into=into).to_json()
                else:
                    reports[rank] = self._write(d, rank, stamp)
        return [reports[r] for r in range(self.world)]

    def _compare(self, rank: int, real: dict[str, Any]) -> None:
        stamp = self.stamps.get(self.signature(rank))
        if stamp is None or real.get("error"):
            return
        header, _, report = stamp.render(rank, self.world, self.offsets(rank))
        mine = {k: v for k, v in real.items() if k not in ("sharded", "replicated")}  # rank 0's extra section
        if report != mine or header != self.sparse.last[0]:
            keys = sorted(k for k in mine if mine.get(k) != report.get(k)) or ["the shard header"]
            raise SystemExit(f"bench_stamp: rank {rank}'s stamp differs from the real write_rank in "
                             f"{', '.join(keys)}: rerun with --exact-emulation")

    def _write(self, d: Path, rank: int, stamp: Stamp) -> dict[str, Any]:
        """The real write_rank's calls for one rank (fsio.makedirs; bench_scale.SparseShards' shard;
        rankindex.write_index beside its fsync; the shard's rename), with the stamped bytes."""
        header, index, report = stamp.render(rank, self.world, self.offsets(rank))
        fsio.makedirs(d, 0o755)
        file = report["file"]
        tmp = d / f".{file}.tmp.{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, header)
            os.ftruncate(fd, len(header) + stamp.data)
            for offset, raw in stamp.real:
                os.pwrite(fd, raw, len(header) + offset)
            fsio.fsync_fd(fd, "shard", tmp)
        finally:
            os.close(fd)
        fsio.write_durable(d / report["index"], index, "index", sync_dir=False)
        fsio.rename(tmp, d / file, "shard")
        if self.drop:
            _UNLINK(d / file)
            _UNLINK(d / report["index"])
        return report


def step_digest(step_dir: Path) -> str:
    """xxh3 of every file of a step: its name, size and each 4 KiB page that is not all zeros, with
    its offset (the sparse shards' holes are skipped by SEEK_DATA, whatever extents the file system
    reports): what --step-digest prints to compare the stamped emulation with --exact-emulation."""
    h = xxhash.xxh3_64()
    for path in sorted(step_dir.iterdir()):
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        fd = os.open(path, os.O_RDONLY)
        try:
            at = 0
            while at < size:
                try:
                    start = os.lseek(fd, at, os.SEEK_DATA)
                except OSError:  # ENXIO: only a hole is left
                    break
                end = os.lseek(fd, start, os.SEEK_HOLE)
                start -= start % 4096
                while start < end:
                    chunk = os.pread(fd, min(end - start, 1 << 24), start)
                    for i in range(0, len(chunk), 4096):
                        if chunk[i:i + 4096].rstrip(b"\0"):
                            h.update(f"{start + i}\0".encode() + chunk[i:i + 4096])
                    start += len(chunk)
                at = end
        finally:
            os.close(fd)
    return h.hexdigest()

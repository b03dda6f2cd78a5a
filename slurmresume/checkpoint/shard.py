"""One rank's shard: a stock safetensors file written by streaming (its reading: `shardread`).

The writer computes the header from tensor metadata, then writes each tensor's bytes straight
from its memory (no second copy of the state), hashing as it goes. It writes to a temp name,
fsyncs, and renames; the caller fsyncs the directory.

Every byte that loads is verified: while writing, each tensor's bytes are hashed in blocks of
VERIFY_BLOCK (xxh3-64) and the header bytes as a whole; the manifest records those digests
(`build_manifest`), and a reader checks each block against them (`shardread.Expected`).
Byte-range reads of a resharded tensor widen to whole blocks (reshard.read_box): a DTensor piece
also gets finer digests, ~64 stripes along its sharded dimension, stored in the header
(`fine_digests`; a GPU piece is copied to the host before the header is built, and that copy is
hashed and streamed). This module also holds what the reader shares with the writer: the format's
constants (VERIFY_BLOCK, SKELETON_KEY, FINE_KEY, MAX_HEADER) and the dtype tables.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError, SaveError, UnsafeCheckpointError
from . import fsio
from .calibrate import open_sink
from .jsonenc import MAX_JSON_BYTES
from .writer import tensor_bytes

VERIFY_BLOCK = 4 << 20  # bytes per recorded digest: small enough to stay in cache between read and hash
SKELETON_KEY = "slurmresume.skeleton"
# Finer digests of the DTensor pieces, for byte-range reads when resharding (`fine_digests`): in the
# header, which the manifest's header digest covers, so the manifest does not grow with them.
FINE_KEY = "slurmresume.fine_blocks"
# The VERIFY_BLOCK digests of every tensor without fine digests (plain tensors, one-row pieces), in
# the header too: a restore then reads a shard's digests from the header it already reads, and opens
# no index file (`whole_digests`; the index keeps them for verify, inspect and older readers).
BLOCKS_KEY = "slurmresume.blocks"
BLOCKS_MAX = 16 << 20  # plain tensor bytes per shard hashed before the header for it; beyond, the index alone
FINE_PER_PIECE = 64  # a piece is cut into about this many row-aligned blocks (at most VERIFY_BLOCK each)
# Stripes across the rows (a Shard(1) piece) are hashed from strided copies into one reused buffer,
# slower than runs of rows (0.2-1 vs 4+ GiB/s on the loaded 2-core VM): every size gets them, since
# a column box of a piece without them reads whole rows (1.3x at 3 -> 2 ranks).
# A piece whose bytes reach host memory only by a copy (a GPU piece, `on_device`) is copied before
# the header is built, hashed from that copy, and the copy is streamed: copies are kept up to this
# many bytes per shard, a piece beyond it is copied again while streaming (host memory stays bounded).
HOST_COPY_KEEP = 1 << 30
MAX_HEADER = MAX_JSON_BYTES

_DTYPES: dict[str, str] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
}
ITEMSIZE = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
             "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def st_dtype(tensor: Any) -> str:
    name = str(tensor.dtype).removeprefix("torch.")
    try:
        return _DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(f"dtype {tensor.dtype} is not supported by safetensors") from None


def _torch_dtypes() -> dict[str, Any]:
    import torch

    return {v: getattr(torch, k) for k, v in _DTYPES.items() if hasattr(torch, k)}


class _LazyDtypes(dict[str, Any]):
    def __missing__(self, key: str) -> Any:
        self.update(_torch_dtypes())
        if key not in self:
            raise UnsafeCheckpointError(f"unsupported tensor dtype {key!r} in shard")
        return dict.__getitem__(self, key)


TORCH_DTYPES: dict[str, Any] = _LazyDtypes()


@dataclass(frozen=True)
class WrittenShard:
    file: str
    bytes: int
    xxh3: str
    tensors: dict[str, dict[str, Any]]  # name -> {dtype, shape, xxh3: [block digests]}
    header_xxh3: str = ""
    writer: str = ""  # the write path used (writer.STRATEGIES)
    timing: dict[str, float] | None = None  # where the seconds went (ShardSink.timing + block_hash_s)


def block_digests(view: memoryview, block: int = VERIFY_BLOCK) -> list[str]:
    """xxh3-64 hex digests of `view` in `block`-byte pieces (the last may be shorter; none when empty)."""
    return [xxhash.xxh3_64_hexdigest(view[i : i + block]) for i in range(0, len(view), block)]


def build_header(tensors: list[tuple[str, Any]], metadata: dict[str, str]) -> tuple[bytes, dict[str, Any]]:
    """safetensors header bytes (8-byte length + padded JSON) and the tensor index."""
    header: dict[str, Any] = {"__metadata__": metadata}
    index: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        dtype = st_dtype(t)
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        index[name] = {"dtype": dtype, "shape": list(t.shape)}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, index


def order_for_alignment(tensors: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Largest itemsize first (as safetensors does) so that every tensor starts aligned."""
    return sorted(tensors, key=lambda nt: (-nt[1].element_size(), nt[0]))


def fine_width(shape: list[int], itemsize: int, dim: int) -> int:
    """Width (indices along `dim`, the piece's sharded dimension) of each fine digest's stripe:
    about FINE_PER_PIECE stripes per piece, each at most VERIFY_BLOCK bytes (or one index wide
    when that is larger); 0 when one stripe would hold the whole piece (its VERIFY_BLOCK digests
    in the manifest are as fine). Along dim 0 a stripe is a run of whole rows. Pure."""
    if not shape or 0 in shape or not 0 <= dim < len(shape):
        return 0
    unit = itemsize
    for i, d in enumerate(shape):
        unit *= d if i != dim else 1
    width = max(1, min(-(-shape[dim] // FINE_PER_PIECE), VERIFY_BLOCK // unit))
    return width if width < shape[dim] else 0


def stripe_digests(t: Any, dim: int, width: int) -> list[str]:
    """xxh3-64 hex digests of `t`'s stripes of `width` along `dim`, each in row-major order."""
    import torch

    if dim == 0:
        return block_digests(tensor_bytes(t.contiguous()), width * (t.element_size() * t.numel() // t.shape[0]))
    buf = torch.empty(t.numel() // t.shape[dim] * width, dtype=t.dtype)  # one buffer for every stripe
    out = []
    for i in range(0, t.shape[dim], width):
        part = t.narrow(dim, i, min(width, t.shape[dim] - i))
        into = buf[: part.numel()].view(part.shape)
        into.copy_(part)
        out.append(xxhash.xxh3_64_hexdigest(tensor_bytes(into)))
    return out


def on_device(t: Any) -> bool:
    """Whether `t`'s bytes reach host memory only by a copy (a GPU tensor). A seam: tests take the
    GPU's path on CPU through it."""
    return bool(t.device.type != "cpu")


def to_host(t: Any) -> Any:
    """A contiguous host copy of a device tensor (the D2H copy of the streaming loop too)."""
    return t.detach().cpu().contiguous()


def sharded_dim(specs: Any, name: str) -> int | None:
    """The first sharded dimension of DTensor piece `name` in the skeleton's "dtensors" specs."""
    spec = specs.get(name) if isinstance(specs, dict) else None
    placements = spec.get("placements") if isinstance(spec, dict) else None
    dims = [int(p[6:]) for p in placements or () if isinstance(p, str) and p[6:].isdigit() and p[:6] == "shard:"]
    return dims[0] if dims else None


def dtensor_specs(skeleton: str) -> dict[str, Any]:
    """The skeleton's "dtensors" specs (JSON text; {} when it has none or is not ours)."""
    try:
        specs = (json.loads(skeleton) or {}).get("dtensors") or {}
    except (ValueError, AttributeError, TypeError):
        return {}
    return specs if isinstance(specs, dict) else {}


def digest_layout(tensors: list[tuple[str, Any]], specs: dict[str, Any],
                  budget: int | None = None) -> tuple[dict[str, tuple[int, int]], list[str]]:
    """Which digests a shard's header carries, decided from shapes alone (the writer and the scale
    harness, which has no bytes to hash, both follow it): ({name: (dim, width)} of the DTensor
    pieces cut into fine stripes along their first sharded dimension (`fine_width`), [names] of
    the tensors given whole block digests: every other DTensor piece (a one-row piece) and the
    plain tensors in order while their bytes stay within `budget` (BLOCKS_MAX: a DDP shard of
    large plain tensors keeps the rest in its index alone, since hashing them before the first
    byte is written would delay the write)). `specs`: the skeleton's (`dtensor_specs`)."""
    stripes: dict[str, tuple[int, int]] = {}
    blocked: list[str] = []
    used, budget = 0, BLOCKS_MAX if budget is None else budget
    for name, t in tensors:
        dim = sharded_dim(specs, name)
        if dim is not None and (width := fine_width(list(t.shape), t.element_size(), dim)):
            stripes[name] = (dim, width)
        elif dim is not None:
            blocked.append(name)
        elif used + (n := t.numel() * t.element_size()) <= budget:
            blocked.append(name)
            used += n
    return stripes, blocked


def fine_digests(tensors: list[tuple[str, Any]], stripes: dict[str, tuple[int, int]],
                 keep: int = HOST_COPY_KEEP) -> tuple[dict[str, dict[str, Any]], list[tuple[str, Any]]]:
    """({name: {"dim", "width", "xxh3": [...]}}, tensors to stream) for the DTensor pieces that
    `stripes` cuts (`digest_layout`): a rank resharding reads a range of such a piece and needs
    digests that end near it. Hashing happens here, before the header is written, in one extra
    pass over these pieces' memory. A piece on a device is copied to the host first and hashed
    there; the copy replaces it in the returned list (streamed without a second copy) while the
    copies kept stay within `keep` bytes."""
    out: dict[str, dict[str, Any]] = {}
    stream, kept = list(tensors), 0
    for i, (name, t) in enumerate(tensors):
        if name not in stripes:
            continue
        dim, width = stripes[name]
        host = to_host(t) if on_device(t) else t.detach()
        out[name] = {"dim": dim, "width": width, "xxh3": stripe_digests(host, dim, width)}
        if host is not t and kept + (n := host.numel() * host.element_size()) <= keep:
            stream[i], kept = (name, host), kept + n
    return out, stream


def whole_digests(tensors: list[tuple[str, Any]], names: list[str],
                  keep: int = HOST_COPY_KEEP) -> tuple[dict[str, str], list[tuple[str, Any]]]:
    """({name: its VERIFY_BLOCK digests concatenated}, tensors to stream) for the tensors `names`
    (`digest_layout`): the same digests the streaming computes for the index (`_agree` checks
    that they are), hashed before the header is written. A tensor on a device is copied to the
    host first and the copy is streamed, while the copies kept stay within `keep`."""
    out: dict[str, str] = {}
    stream, kept, wanted = list(tensors), 0, set(names)
    for i, (name, t) in enumerate(tensors):
        if name not in wanted:
            continue
        host = to_host(t) if on_device(t) else t.detach().contiguous()
        out[name] = "".join(block_digests(tensor_bytes(host)))
        if on_device(t) and kept + (n := t.numel() * t.element_size()) <= keep:  # else copied again then
            stream[i], kept = (name, host), kept + n
    return out, stream


@dataclass
class ShardPlan:
    """What a shard will hold, decided before a byte is written: its header and its size
    (`bytes`), which a node file (`nodefile`) needs to agree each rank's range first."""

    header: bytes
    index: dict[str, Any]
    tensors: list[tuple[str, Any]]
    hosted: set[int]
    bytes: int
    blocks: dict[str, str] = field(default_factory=dict)  # the header's BLOCKS_KEY digests


def header_with_digests(tensors: list[tuple[str, Any]], metadata: dict[str, str], fine: dict[str, Any],
                        blocks: dict[str, str]) -> tuple[bytes, dict[str, Any], dict[str, str]]:
    """`build_header` with the fine digests and the block digests in its metadata (the blocks left
    out when the header would pass the read cap with them: the index alone carries those).
    Returns (header, index, the blocks the header holds)."""
    if fine:
        metadata = {**metadata, FINE_KEY: json.dumps(fine, separators=(",", ":"))}
    if blocks:
        header, index = build_header(tensors, {**metadata, BLOCKS_KEY: json.dumps(blocks, separators=(",", ":"))})
        if len(header) - 8 <= MAX_HEADER:
            return header, index, blocks
    header, index = build_header(tensors, metadata)
    return header, index, {}


def plan_shard(final: Path, tensors: list[tuple[str, Any]], metadata: dict[str, str]) -> ShardPlan:
    tensors = order_for_alignment(tensors)
    stripes, blocked = digest_layout(tensors, dtensor_specs(metadata.get(SKELETON_KEY, "")))
    fine, stream = fine_digests(tensors, stripes)
    blocks, stream = whole_digests(stream, blocked)
    hosted = {id(b) for (_, a), (_, b) in zip(tensors, stream) if a is not b}  # copied already: stream as is
    tensors = stream
    header, index, blocks = header_with_digests(tensors, metadata, fine, blocks)
    if len(header) - 8 > MAX_HEADER:  # the reader refuses it: never write (and commit) what cannot load
        raise SaveError(f"the safetensors header of {final} would be {len(header) - 8} bytes ({len(tensors)} "
                        f"tensors), over the {MAX_HEADER}-byte header read cap of this version; save fewer, "
                        "larger tensors or less non-tensor state per rank")
    needed = len(header) + sum(t.numel() * t.element_size() for _, t in tensors)
    return ShardPlan(header, index, tensors, hosted, needed, blocks)


def stream_shard(sink: Any, plan: ShardPlan, label: Path) -> str:
    """Feed the plan's header and tensors to `sink` and finish it (its fsync unless the sink
    leaves that to a node file's owner). Returns the xxh3 of the bytes; fills the block digests."""
    _feed(sink, plan, label)
    digest: str = sink.finish()
    _agree(plan, label)
    return digest


def _feed(sink: Any, plan: ShardPlan, label: Path) -> None:
    fsio.fault_point("write.shard.header", label)
    sink.feed(plan.header)
    for name, t in plan.tensors:  # each block is queued (or staged), the hasher digests it meanwhile
        data = tensor_bytes(t if id(t) in plan.hosted else _contiguous_cpu(t))
        plan.index[name]["xxh3"] = sink.feed_blocks(data, VERIFY_BLOCK)


def _agree(plan: ShardPlan, label: Path) -> None:
    """Once the hasher has drained: the digests hashed before the header (BLOCKS_KEY) are those of
    the bytes written. Never commit a header that lies (a tensor changed during the save)."""
    for name, digests in plan.blocks.items():
        if "".join(plan.index[name]["xxh3"]) != digests:
            raise SaveError(f"tensor {name!r} changed while {label} was being written (its bytes no longer "
                            "match the digests in the shard's header); nothing of this save is committed")


def written(file: str, plan: ShardPlan, sink: Any, digest: str) -> WrittenShard:
    return WrittenShard(file=file, bytes=sink.total, xxh3=digest, tensors=plan.index,
                        header_xxh3=xxhash.xxh3_64_hexdigest(plan.header), writer=sink.strategy, timing=sink.timing())


def write_shard(directory: Path, file: str, tensors: list[tuple[str, Any]], metadata: dict[str, str],
                beside: Callable[[dict[str, dict[str, Any]]], None] | None = None) -> WrittenShard:
    """Write one shard durably (temp, fsync, rename). Called by each rank for its own file.
    Tensor bytes stream from tensor memory (or the writer's reused staging buffers), hashed on
    the writer's hasher thread. `beside(index)`, given the tensor index with its block digests,
    runs while the shard's fsync does (another file written meanwhile: the rank's index); the
    shard is renamed only after both are done. A failure of either removes the shard's temp
    file and raises."""
    final = directory / file
    plan = plan_shard(final, tensors, metadata)
    tmp = directory / f".{file}.tmp.{os.getpid()}"
    needed = plan.bytes
    try:
        sink = open_sink(tmp, size_hint=needed)
    except BaseException as exc:
        fsio.note_failure(exc, final, needed)
        raise
    try:
        _feed(sink, plan, tmp)
        digest = sink.drain()
        _agree(plan, tmp)
        fsio.fault_point("fsync.shard", tmp)  # crossed here, on the caller's thread: labels keep their order
        _overlapped(lambda: sink.sync(crossed=True), lambda: beside(plan.index) if beside else None)
        sink.report()  # here: the caller's thread knows whether this save is an emergency
    except BaseException as exc:
        sink.abort()
        fsio._unlink_quiet(tmp)
        fsio.note_failure(exc, final, needed)
        raise
    try:
        fsio.rename(tmp, final, "shard")
    except BaseException as exc:
        fsio._unlink_quiet(tmp)
        fsio.note_failure(exc, final, needed)
        raise
    return written(file, plan, sink, digest)


def _overlapped(background: Callable[[], None], foreground: Callable[[], None]) -> None:
    """Run `background` on a thread while `foreground` runs here; wait for both; raise the
    foreground's error, else the background's."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            background()
        except BaseException as exc:  # raised on the caller's thread below
            failed.append(exc)

    thread = threading.Thread(target=run, name="slurmresume-shard-fsync", daemon=True)
    thread.start()
    try:
        foreground()
    finally:
        thread.join()
    if failed:
        raise failed[0]


def _contiguous_cpu(t: Any) -> Any:
    return to_host(t) if on_device(t) else t.detach().contiguous()

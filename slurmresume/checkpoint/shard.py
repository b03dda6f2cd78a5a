"""One rank's shard: a stock safetensors file written by streaming, read back with bounds checks.

The writer computes the header from tensor metadata, then writes each tensor's bytes straight
from its memory (no second copy of the state), hashing as it goes. It writes to a temp name,
fsyncs, and renames; the caller fsyncs the directory.

Every byte that loads is verified: while writing, each tensor's bytes are hashed in blocks of
VERIFY_BLOCK (xxh3-64) and the header bytes as a whole; the manifest records those digests
(`build_manifest`). A reader given them (`Expected`) hashes each block right after reading it
(the block is still in cache) and refuses a mismatch with CorruptCheckpointError, so the default
restore needs no separate checksum pass. Byte-range reads of a resharded tensor widen to whole
blocks (reshard.read_box): a DTensor piece also gets finer digests, ~64 stripes along its
sharded dimension, stored in the header (`fine_digests`; a GPU piece is copied to the host
before the header is built, and that copy is hashed and streamed). Checkpoints written before
block digests existed carry none; their restore runs the whole-shard checksum pass instead
(restoring.choose).
"""

from __future__ import annotations

import json
import math
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError, SaveError, UnsafeCheckpointError
from . import fsio
from .calibrate import open_sink
from .jsonenc import MAX_JSON_BYTES, loads
from .writer import tensor_bytes

CHUNK = 64 << 20
VERIFY_BLOCK = 4 << 20  # bytes per recorded digest: small enough to stay in cache between read and hash
SKELETON_KEY = "slurmresume.skeleton"
# Finer digests of the DTensor pieces, for byte-range reads when resharding (`fine_digests`): in the
# header, which the manifest's header digest covers, so the manifest does not grow with them.
FINE_KEY = "slurmresume.fine_blocks"
FINE_PER_PIECE = 64  # a piece is cut into about this many row-aligned blocks (at most VERIFY_BLOCK each)
# Stripes across the rows (a Shard(1) piece) are hashed from strided copies into one reused buffer,
# slower than runs of rows (0.2-1 vs 4+ GiB/s on the loaded 2-core VM): every size gets them, since
# a column box of a piece without them reads whole rows (1.3x at 3 -> 2 ranks).
# A piece whose bytes reach host memory only by a copy (a GPU piece, `on_device`) is copied before
# the header is built, hashed from that copy, and the copy is streamed: copies are kept up to this
# many bytes per shard, a piece beyond it is copied again while streaming (host memory stays bounded).
HOST_COPY_KEEP = 1 << 30
MAX_HEADER = MAX_JSON_BYTES
_INT = {int}  # exact ints from JSON (not bools, not floats that equal them)

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


@dataclass(frozen=True)
class WrittenShard:
    file: str
    bytes: int
    xxh3: str
    tensors: dict[str, dict[str, Any]]  # name -> {dtype, shape, xxh3: [block digests]}
    header_xxh3: str = ""
    writer: str = ""  # the write path used (writer.STRATEGIES)
    timing: dict[str, float] | None = None  # where the seconds went (ShardSink.timing + block_hash_s)


@dataclass(frozen=True)
class Expected:
    """What a verified read of one shard checks: the digest of its header bytes (8-byte length +
    JSON) and, per tensor name, the digests of its bytes in VERIFY_BLOCK blocks."""

    header: str
    blocks: Mapping[str, list[str]]  # (Manifest.expected: read from the index file when first asked)
    block: int = VERIFY_BLOCK

    def of(self, name: str, path: Path) -> list[str]:
        try:
            return self.blocks[name]
        except KeyError:
            raise CorruptCheckpointError(f"shard {path}: the manifest records no checksum for tensor {name!r}") from None


def block_digests(view: memoryview, block: int = VERIFY_BLOCK) -> list[str]:
    """xxh3-64 hex digests of `view` in `block`-byte pieces (the last may be shorter; none when empty)."""
    return [xxhash.xxh3_64_hexdigest(view[i : i + block]) for i in range(0, len(view), block)]


def check_blocks(view: memoryview, first_block: int, digests: list[str], path: Path, name: str,
                 block: int = VERIFY_BLOCK) -> None:
    """`view` holds blocks first_block, first_block+1, ... of tensor `name` (block-aligned): each must
    match its recorded digest."""
    for i in range(0, len(view), block):
        k = first_block + i // block
        if k >= len(digests) or xxhash.xxh3_64_hexdigest(view[i : i + block]) != digests[k]:
            raise CorruptCheckpointError(f"shard {path}: tensor {name!r} fails its checksum at bytes "
                                         f"{k * block}..{k * block + min(block, len(view) - i)} (flipped bits?)")


def byte_view(tensor: Any) -> memoryview:
    """The tensor's bytes without copying (a contiguous CPU tensor is required)."""
    import torch

    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


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


def fine_digests(tensors: list[tuple[str, Any]], skeleton: str,
                 keep: int = HOST_COPY_KEEP) -> tuple[dict[str, dict[str, Any]], list[tuple[str, Any]]]:
    """({name: {"dim", "width", "xxh3": [...]}}, tensors to stream) for the DTensor pieces (named
    in the skeleton's "dtensors", cut along their first sharded dimension): a rank resharding
    reads a range of such a piece and needs digests that end near it. Hashing happens here,
    before the header is written, in one extra pass over these pieces' memory. A piece on a
    device is copied to the host first and hashed there; the copy replaces it in the returned
    list (streamed without a second copy) while the copies kept stay within `keep` bytes."""
    try:
        specs = (json.loads(skeleton) or {}).get("dtensors") or {}
    except (ValueError, AttributeError, TypeError):
        return {}, tensors
    out: dict[str, dict[str, Any]] = {}
    stream, kept = list(tensors), 0
    for i, (name, t) in enumerate(tensors):
        dim = sharded_dim(specs, name)
        if dim is None or not (width := fine_width(list(t.shape), t.element_size(), dim)):
            continue
        host = to_host(t) if on_device(t) else t.detach()
        out[name] = {"dim": dim, "width": width, "xxh3": stripe_digests(host, dim, width)}
        if host is not t and kept + (n := host.numel() * host.element_size()) <= keep:
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


def plan_shard(final: Path, tensors: list[tuple[str, Any]], metadata: dict[str, str]) -> ShardPlan:
    tensors = order_for_alignment(tensors)
    fine, stream = fine_digests(tensors, metadata.get(SKELETON_KEY, ""))
    hosted = {id(b) for (_, a), (_, b) in zip(tensors, stream) if a is not b}  # copied already: stream as is
    tensors = stream
    if fine:
        metadata = {**metadata, FINE_KEY: json.dumps(fine, separators=(",", ":"))}
    header, index = build_header(tensors, metadata)
    if len(header) - 8 > MAX_HEADER:  # the reader refuses it: never write (and commit) what cannot load
        raise SaveError(f"the safetensors header of {final} would be {len(header) - 8} bytes ({len(tensors)} "
                        f"tensors), over the {MAX_HEADER}-byte header read cap of this version; save fewer, "
                        "larger tensors or less non-tensor state per rank")
    needed = len(header) + sum(t.numel() * t.element_size() for _, t in tensors)
    return ShardPlan(header, index, tensors, hosted, needed)


def stream_shard(sink: Any, plan: ShardPlan, label: Path) -> str:
    """Feed the plan's header and tensors to `sink` and finish it (its fsync unless the sink
    leaves that to a node file's owner). Returns the xxh3 of the bytes; fills the block digests."""
    _feed(sink, plan, label)
    digest: str = sink.finish()
    return digest


def _feed(sink: Any, plan: ShardPlan, label: Path) -> None:
    fsio.fault_point("write.shard.header", label)
    sink.feed(plan.header)
    for name, t in plan.tensors:  # each block is queued (or staged), the hasher digests it meanwhile
        data = tensor_bytes(t if id(t) in plan.hosted else _contiguous_cpu(t))
        plan.index[name]["xxh3"] = sink.feed_blocks(data, VERIFY_BLOCK)


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


def open_checked(directory: Path, file: str, expected_bytes: int) -> int:
    """Open a shard for reading after refusing anything that is not a plain regular file of the
    expected size inside `directory`. Returns an fd (O_NOFOLLOW, so a swapped-in link fails)."""
    from .layout import is_plain_step_file

    if not is_plain_step_file(file):
        raise UnsafeCheckpointError(f"refusing shard name {file!r} in {directory}: not a plain shard file name")
    name, base = split_locator(file)
    path = directory / name
    try:
        fd = fsio.retry_transient("read.shard.open", path,
                                  lambda: os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"shard {path} is missing") from None
    except OSError as exc:
        if exc.errno in fsio.TRANSIENT_ERRNOS:
            raise CorruptCheckpointError(f"cannot open shard {path}: {exc.strerror} (after retries)") from None
        raise UnsafeCheckpointError(f"refusing shard {path}: {exc.strerror} (symlink or special file?)") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise UnsafeCheckpointError(f"refusing shard {path}: not a regular file")
    if st.st_size != expected_bytes if base is None else st.st_size < base + expected_bytes:
        os.close(fd)
        raise CorruptCheckpointError(
            f"shard {directory / file} is {st.st_size} bytes, the manifest says {expected_bytes}"
            f"{'' if base is None else f' from byte {base}'}: truncated or replaced"
        )
    return fd


def split_locator(file: str) -> tuple[str, int | None]:
    """A manifest's file entry: a rank's own file (base None), or "NAME@OFFSET", that rank's
    range of a node file (`nodefile`: its bytes are [OFFSET, OFFSET + bytes) of NAME)."""
    name, at, base = file.partition("@")
    return (name, int(base)) if at else (file, None)


def shard_base(file: str) -> int:
    return split_locator(file)[1] or 0


def hash_file(directory: Path, file: str, expected_bytes: int) -> str:
    fd = open_checked(directory, file, expected_bytes)
    hasher = xxhash.xxh3_64()
    _, at = split_locator(file)
    base, left = at or 0, None if at is None else expected_bytes  # a node file's range ends before the file
    try:
        with os.fdopen(fd, "rb", buffering=0) as f:
            buf = bytearray(min(CHUNK, expected_bytes + 1))  # not 64 MiB per small shard
            view = memoryview(buf)
            f.seek(base)
            while left != 0 and (n := f.readinto(buf if left is None else view[: min(len(buf), left)])):
                hasher.update(view[:n])
                left = None if left is None else left - n
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read shard {directory / file}: {exc}") from exc
    return hasher.hexdigest()


def read_header(directory: Path, file: str, expected_bytes: int, expect: Expected | None = None,
                fd: int | None = None) -> tuple[dict[str, Any], int]:
    """Parse and bound-check a shard's header (checked against `expect.header` when given).
    Returns (header, data_start). `fd`: the file, already opened by `open_checked` (left open)."""
    path = directory / file
    own = fd is None
    if fd is None:
        fd = open_checked(directory, file, expected_bytes)  # refuses a name that is not ours first
    base = shard_base(file)
    try:
        try:
            head = fsio.retry_transient("read.shard.header", path, lambda: os.pread(fd, 8, base))
            if len(head) < 8:
                raise CorruptCheckpointError(f"shard {path} is too short to be safetensors")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > expected_bytes:
                raise UnsafeCheckpointError(f"shard {path} claims a {n}-byte header: refused")
            raw = fsio.retry_transient("read.shard.header", path, lambda: os.pread(fd, n, base + 8))
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot read shard {path}: {exc} (after retries)") from exc
    finally:
        if own:
            os.close(fd)
    if expect is not None and xxhash.xxh3_64_hexdigest(head + raw) != expect.header:
        raise CorruptCheckpointError(f"shard {path}: its header fails its checksum (flipped bits?)")
    header = loads(raw, f"header of {path}")
    if not isinstance(header, dict):
        raise UnsafeCheckpointError(f"header of {path} is not an object")
    data_len = expected_bytes - 8 - n
    spans = sorted((*_offsets(path, name, info), name, info) for name, info in header.items() if name != "__metadata__")
    end = 0
    for begin, stop, name, info in spans:  # one pass per entry: 405B's 3,411 tensors are a restore plan's share
        dtype, shape = info.get("dtype"), info.get("shape")
        if not (type(dtype) is str and dtype in ITEMSIZE and type(shape) is list and set(map(type, shape)) <= _INT
                and (not shape or min(shape) >= 0)):
            raise UnsafeCheckpointError(f"tensor {name!r} in {path} has a bad dtype or shape")
        if begin != end or stop - begin != math.prod(shape) * ITEMSIZE[dtype] or stop > data_len:
            raise UnsafeCheckpointError(f"tensor {name!r} in {path} has offsets outside the file")
        end = stop
    if end != data_len:
        raise CorruptCheckpointError(f"shard {path}: tensor data does not fill the file")
    return header, base + 8 + n  # where the data starts in the file (a node file: in its range)


def _offsets(path: Path, name: str, info: Any) -> tuple[int, int]:
    offs = info.get("data_offsets") if type(info) is dict else None
    if not (type(offs) is list and len(offs) == 2 and type(offs[0]) is int and type(offs[1]) is int
            and 0 <= offs[0] <= offs[1]):
        raise UnsafeCheckpointError(f"tensor {name!r} in {path} has malformed data_offsets")
    return offs[0], offs[1]


def open_read(directory: Path, file: str, expected_bytes: int, expect: Expected | None = None,
              opened: Any = None) -> tuple[int, dict[str, Any], int, bool]:
    """(fd, checked header, data start, whether the caller closes the fd) of one shard: through
    `opened` (an opened.OpenShards: a restore's fds, kept from its plan to its last read) when
    given, else one `open_checked` whose fd the header is read through and the data after it
    (one open per file, and the bytes read are those of the file whose header was checked). The
    one place the readers (`load_tensors`, `verify_tensors`, reshard.ShardFiles) choose."""
    if opened is not None:
        return (*opened.get(file, expected_bytes, expect), False)
    fd = open_checked(directory, file, expected_bytes)
    try:
        header, start = read_header(directory, file, expected_bytes, expect, fd=fd)
    except BaseException:
        os.close(fd)
        raise
    return fd, header, start, True


def load_tensors(directory: Path, file: str, expected_bytes: int, targets: dict[str, Any] | None = None,
                 names: set[str] | None = None, expect: Expected | None = None,
                 opened: Any = None) -> tuple[dict[str, Any], dict[str, str], bool]:
    """All tensors of a shard, its metadata, and whether any target was written.

    A tensor whose name is in `targets` with the same dtype and shape (a contiguous CPU tensor,
    e.g. a model parameter) is read straight into that tensor's memory: one copy from the file,
    no fresh memory. The others are read into fresh tensors, each owning exactly its bytes (user
    code may need that: `Generator.set_state` reads a view's storage from offset 0). `names`
    limits the read to those tensors (only their byte ranges). With `expect`, the header and
    every tensor's bytes are checked against their digests as they are read (a mismatch in a
    live tensor sets `partial_write` on the error). `opened` (restore.OpenShards): the file and
    its header as the restore's plan opened and checked them, read through that fd."""
    import torch

    fd, header, data_start, owned = open_read(directory, file, expected_bytes, expect, opened)
    path = directory / file
    out: dict[str, Any] = {}
    try:
        meta = header.get("__metadata__") or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise UnsafeCheckpointError(f"metadata of {directory / file} is malformed")
        items = [(n, i) for n, i in header.items() if n != "__metadata__" and (names is None or n in names)]
        direct: dict[str, Any] = {}
        for name, info in items:
            t = (targets or {}).get(name)
            if (t is not None and t.device.type == "cpu" and t.is_contiguous() and list(t.shape) == info["shape"]
                    and TORCH_DTYPES[info["dtype"]] == t.dtype and t.numel() > 0):
                direct[name] = t
        rest = [(n, i) for n, i in items if n not in direct]
        for name, info in rest:
            begin, end = info["data_offsets"]
            part = torch.empty(end - begin, dtype=torch.uint8)  # one per tensor, not views of one buffer
            _pread_into(fd, part, data_start + begin, path, _check(expect, name, path))
            out[name] = _typed(part, info)
        try:
            for name, t in direct.items():
                _pread_into(fd, t, data_start + info_offsets(header, name), path, _check(expect, name, path))
                out[name] = t
        except CorruptCheckpointError as exc:
            exc.partial_write = True  # type: ignore[attr-defined]  # live tensors were touched
            raise
    finally:
        if owned:
            os.close(fd)
    return out, meta, bool(direct)


def verify_tensors(directory: Path, file: str, expected_bytes: int, names: set[str], expect: Expected | None,
                   opened: Any = None) -> int:
    """Read the named tensors of a shard and check every block against `expect`, through one
    VERIFY_BLOCK scratch buffer: nothing is kept (the first pass of a restore too large to stage).
    Without `expect` (a checkpoint older than block digests, whose shards were checked whole
    already) nothing is read. Returns the bytes read. `opened`: as for `load_tensors`."""
    if expect is None:
        return 0
    fd, header, data_start, owned = open_read(directory, file, expected_bytes, expect, opened)
    path, scratch, done = directory / file, memoryview(bytearray(VERIFY_BLOCK)), 0
    try:
        for name in sorted(names):
            begin, end = header[name]["data_offsets"]
            digests = expect.of(name, path)
            if len(digests) != -(-(end - begin) // VERIFY_BLOCK):
                raise CorruptCheckpointError(f"shard {path}: the manifest records {len(digests)} checksum blocks "
                                             f"for tensor {name!r} of {end - begin} bytes")
            for i in range(0, end - begin, VERIFY_BLOCK):
                piece = scratch[: min(VERIFY_BLOCK, end - begin - i)]
                pread_exact(fd, piece, data_start + begin + i, path)
                check_blocks(piece, i // VERIFY_BLOCK, digests, path, name)
            done += end - begin
    finally:
        if owned:
            os.close(fd)
    return done


def info_offsets(header: dict[str, Any], name: str) -> int:
    return int(header[name]["data_offsets"][0])


def _check(expect: Expected | None, name: str, path: Path) -> tuple[str, list[str]] | None:
    return None if expect is None else (name, expect.of(name, path))


def _pread_into(fd: int, t: Any, offset: int, path: Path, check: tuple[str, list[str]] | None = None) -> None:
    view = byte_view(t) if t.numel() else memoryview(b"")
    if check is None:
        if len(view):
            pread_exact(fd, view, offset, path)
        return
    name, digests = check
    if len(digests) != -(-len(view) // VERIFY_BLOCK):
        raise CorruptCheckpointError(f"shard {path}: the manifest records {len(digests)} checksum blocks for "
                                     f"tensor {name!r}, its {len(view)} bytes need {-(-len(view) // VERIFY_BLOCK)}")
    for i in range(0, len(view), VERIFY_BLOCK):  # read a block, hash it while it is in cache
        piece = view[i : i + VERIFY_BLOCK]
        pread_exact(fd, piece, offset + i, path)
        check_blocks(piece, i // VERIFY_BLOCK, digests, path, name)


def pread_exact(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill `view` from `fd` at `offset` (in CHUNK reads); a short file or an I/O error is a
    CorruptCheckpointError naming the shard."""
    pos = 0
    try:
        while pos < len(view):
            n = fsio.retry_transient("read.shard.data", path, partial(os.preadv, fd, [view[pos : pos + CHUNK]],
                                                                      offset + pos))
            if n <= 0:
                raise CorruptCheckpointError(f"shard {path} ended early while reading")
            pos += n
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read shard {path}: {exc}") from exc


def _typed(part: Any, info: dict[str, Any]) -> Any:
    dtype = TORCH_DTYPES[info["dtype"]]
    try:
        t = part.view(dtype)
    except RuntimeError:  # not aligned for this dtype (a file we did not write): copy it
        t = part.clone().view(dtype)
    return t.reshape(info["shape"])


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


def meta_tensors(infos: dict[str, Any]) -> dict[str, Any]:
    """Shape-only (meta device) tensors for header entries: lets a skeleton be decoded and
    checked against the live state without reading or allocating any tensor bytes."""
    import torch

    try:
        return {n: torch.empty([int(d) for d in i["shape"]], dtype=TORCH_DTYPES[i["dtype"]], device="meta")
                for n, i in infos.items()}
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CorruptCheckpointError(f"a safetensors header entry is malformed ({type(exc).__name__}: {exc})") from None


class MetaOnDemand(dict[str, Any]):
    """`meta_tensors` of `infos` ({name: {"dtype", "shape"}}) and of the DTensors `sharded` (name ->
    sharding.Sharded: its global shape), each made when first looked up: a plan that decodes only
    some entries (those of modules and optimizers, to check they fit) makes no meta tensor for the
    others. A name in neither raises KeyError, as a dict would."""

    def __init__(self, infos: Mapping[str, Any], sharded: Mapping[str, Any]) -> None:
        super().__init__()
        self.infos, self.sharded = infos, sharded

    def __missing__(self, name: str) -> Any:
        if name in self.sharded:
            info = {"dtype": self.sharded[name].dtype, "shape": list(self.sharded[name].shape)}
        else:
            info = self.infos[name]
        t = self[name] = meta_tensors({name: info})[name]
        return t

"""Reading one rank's shard (written by `shard`): every name, size, offset and byte checked.

`open_checked` refuses anything but a plain regular file of the manifest's size; `read_header`
bound-checks the safetensors header (and its digest); `open_read` is the one place the readers
choose between a restore's kept fds (`opened.OpenShards`) and one open of their own. A reader
given the manifest's digests (`Expected`) hashes each VERIFY_BLOCK block right after reading it
(the block is still in cache) and refuses a mismatch with CorruptCheckpointError, so the default
restore needs no separate checksum pass (`load_tensors`, `verify_tensors`; reshard.read_box reads
byte ranges through `pread_exact` and `check_blocks`). Checkpoints written before block digests
existed carry none; their restore runs the whole-shard checksum pass instead (`hash_file`,
restorechoice.choose).
"""

from __future__ import annotations

import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from . import fsio
from .bounded import open_regular
from .jsonenc import loads
from .shard import BLOCKS_KEY, ITEMSIZE, MAX_HEADER, TORCH_DTYPES, VERIFY_BLOCK

CHUNK = 64 << 20
_HEX = re.compile(r"[0-9a-f]*")
_INT = {int}  # exact ints from JSON (not bools, not floats that equal them)


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


class Header(dict[str, Any]):
    """A shard's parsed header (`read_header`), with the block digests it carries for its tensors
    (`shard.BLOCKS_KEY`), parsed when first asked. Only a reader that checked the header against
    the manifest's digest (`Expected.header`) trusts them: see `digests_of`."""

    _blocks: dict[str, str] | None = None

    def blocks(self, path: Path) -> dict[str, str]:
        """{name: its VERIFY_BLOCK digests concatenated}; an entry this version does not
        understand is left out (that tensor's digests come from the index instead)."""
        if self._blocks is None:
            meta = self.get("__metadata__")
            raw = meta.get(BLOCKS_KEY) if isinstance(meta, dict) else None
            data = loads(raw, f"block digests of {path}") if isinstance(raw, str) else None
            self._blocks = {n: d for n, d in data.items() if type(d) is str and len(d) % 16 == 0
                            and _HEX.fullmatch(d)} if isinstance(data, dict) else {}
        return self._blocks


def digests_of(expect: Expected, header: Mapping[str, Any], name: str, path: Path) -> list[str]:
    """The VERIFY_BLOCK digests a verified read of tensor `name` checks: those in the shard's own
    header when it has them (`expect` checked the header against the manifest, so they are the
    manifest's word), else the index's (`Expected.of`, which opens the index file when first
    asked): a restore of a shard whose header carries every digest it reads opens no index."""
    got = header.blocks(path).get(name) if isinstance(header, Header) else None
    if got is None:
        return expect.of(name, path)
    return [got[i : i + 16] for i in range(0, len(got), 16)]


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


def open_checked(directory: Path, file: str, expected_bytes: int) -> int:
    """Open a shard for reading after refusing anything that is not a plain regular file of the
    expected size inside `directory`. Returns an fd (O_NOFOLLOW, so a swapped-in link fails)."""
    check_name(directory, file)
    name, base = split_locator(file)
    path = directory / name
    fd, st = open_regular(path, "shard", "read.shard.open", verb="open", hint=" (symlink or special file?)")
    try:
        check_span(directory, file, expected_bytes, st.st_size)
    except CorruptCheckpointError:
        os.close(fd)
        raise
    return fd


def check_name(directory: Path, file: str) -> None:
    """UnsafeCheckpointError unless `file` (a manifest's entry) names a plain shard file or range."""
    from .layout import is_plain_step_file

    if not is_plain_step_file(file):
        raise UnsafeCheckpointError(f"refusing shard name {file!r} in {directory}: not a plain shard file name")


def check_span(directory: Path, file: str, expected_bytes: int, size: int) -> None:
    """A shard file of `size` bytes holds `file`'s `expected_bytes` (all of it; a node file's
    range: from its offset). CorruptCheckpointError naming it otherwise."""
    base = split_locator(file)[1]
    if size != expected_bytes if base is None else size < base + expected_bytes:
        raise CorruptCheckpointError(
            f"shard {directory / file} is {size} bytes, the manifest says {expected_bytes}"
            f"{'' if base is None else f' from byte {base}'}: truncated or replaced"
        )


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
    if expect is not None and _header_digest(head, raw) != expect.header:
        raise CorruptCheckpointError(f"shard {path}: its header fails its checksum (flipped bits?)")
    parsed = loads(raw, f"header of {path}")
    if not isinstance(parsed, dict):
        raise UnsafeCheckpointError(f"header of {path} is not an object")
    header = Header(parsed)
    data_len = expected_bytes - 8 - n
    if _tiles_in_order(header, data_len):
        return header, base + 8 + n
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


def _header_digest(head: bytes, raw: bytes) -> str:
    """xxh3 of the 8 length bytes and the header, without joining them (405B: a 1.3 MB copy)."""
    hasher = xxhash.xxh3_64(head)
    hasher.update(raw)
    return hasher.hexdigest()


def _tiles_in_order(header: dict[str, Any], data_len: int) -> bool:
    """Whether the header's entries, in the order written (our writer's: by offset), each have a
    known dtype, a shape of non-negative ints and exact int offsets of its size, and tile the data
    [0, data_len) without gap or overlap: the per-entry checks of `read_header`, in one pass with
    no sort and the size worked out once per distinct (dtype, shape). False: not shown so (an
    entry out of order, or anything wrong), for `read_header`'s own checks to accept or refuse."""
    end, sizes = 0, dict[tuple[Any, ...], int]()
    try:
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if type(info) is not dict:
                return False
            offs, dtype, shape = info.get("data_offsets"), info.get("dtype"), info.get("shape")
            if not (type(offs) is list and len(offs) == 2 and type(shape) is list and set(map(type, shape)) <= _INT):
                return False
            begin, stop = offs
            key = (dtype, *shape)  # exact ints (checked above): no 1.0 or True sharing a key with 1
            size = sizes.get(key)
            if size is None:
                if not (type(dtype) is str and dtype in ITEMSIZE and (not shape or min(shape) >= 0)):
                    return False
                size = sizes[key] = math.prod(shape) * ITEMSIZE[dtype]
            if not (type(begin) is int and type(stop) is int and begin == end and stop - begin == size):
                return False
            end = stop
    except TypeError:  # an unhashable dtype
        return False
    return end == data_len


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
            _pread_into(fd, part, data_start + begin, path, _check(expect, header, name, path),
                        _mapping(opened, fd, data_start + begin, end - begin, path))
            out[name] = _typed(part, info)
        try:
            for name, t in direct.items():
                at = data_start + info_offsets(header, name)
                _pread_into(fd, t, at, path, _check(expect, header, name, path),
                            _mapping(opened, fd, at, t.numel() * t.element_size(), path))
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
            digests = digests_of(expect, header, name, path)
            if len(digests) != -(-(end - begin) // VERIFY_BLOCK):
                raise CorruptCheckpointError(f"shard {path}: the manifest records {len(digests)} checksum blocks "
                                             f"for tensor {name!r} of {end - begin} bytes")
            src = _mapping(opened, fd, data_start + begin, end - begin, path)
            if src is not None:  # hashed where it lies, nothing copied (checkpoint/mapped.py)
                check_blocks(src, 0, digests, path, name)
            for i in range(0, end - begin, VERIFY_BLOCK) if src is None else ():
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


def _check(expect: Expected | None, header: Mapping[str, Any], name: str, path: Path) -> tuple[str, list[str]] | None:
    return None if expect is None else (name, digests_of(expect, header, name, path))


def _mapping(opened: Any, fd: int, offset: int, length: int, path: Path) -> memoryview | None:
    """The bytes at `offset` through the restore's mapping of `fd` (`opened.maps`: the memory
    tier, checkpoint/mapped.py), or None: read them with `pread`."""
    maps = getattr(opened, "maps", None)
    return maps.view(fd, offset, length, path) if maps is not None else None


def _pread_into(fd: int, t: Any, offset: int, path: Path, check: tuple[str, list[str]] | None = None,
                src: memoryview | None = None) -> None:
    """`t`'s bytes from `fd` at `offset` (or copied from `src`, a mapping of them), each
    VERIFY_BLOCK block checked against `check`'s digests right after it landed in `t`."""
    view = byte_view(t) if t.numel() else memoryview(b"")
    if src is not None and len(src) != len(view):
        src = None
    if check is None:
        if len(view) and src is not None:
            view[:] = src
        elif len(view):
            pread_exact(fd, view, offset, path)
        return
    name, digests = check
    if len(digests) != -(-len(view) // VERIFY_BLOCK):
        raise CorruptCheckpointError(f"shard {path}: the manifest records {len(digests)} checksum blocks for "
                                     f"tensor {name!r}, its {len(view)} bytes need {-(-len(view) // VERIFY_BLOCK)}")
    for i in range(0, len(view), VERIFY_BLOCK):  # read (or copy) a block, hash it while it is in cache
        piece = view[i : i + VERIFY_BLOCK]
        if src is not None:
            piece[:] = src[i : i + VERIFY_BLOCK]
        else:
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

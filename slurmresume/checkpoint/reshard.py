"""Verified byte-range reads of a sharded (DTensor / FSDP2) tensor's box: restored onto any
number of ranks and any sharding by reading only the byte ranges each rank needs.

Restore (every rank, independently, no collective): for each sharded name, the box this rank now
owns (`boxes`: its `Target`), `sharding.cover` finds the saved pieces that
intersect it, and `read_box` preads only their intersecting runs from the old shards (one run
per piece for dim-0 sharding) into fresh memory; the caller copies into the live tensors once
every rank has verified its part. Verified reads widen to the piece's fine stripes (its
shard header's `shard.FINE_KEY` digests) or, without them, to the VERIFY_BLOCK
blocks of whole rows (the header's `shard.BLOCKS_KEY` digests, else the rank's index file's) (`_read_verified`, `_read_striped`). Data bytes read, and the bytes of the boxes they were read
for (`needed`), are counted in `STATS` (the restore's `restored` event, the benchmark and tests
read it). What a saved DTensor is: `dtensorspec`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError
from .boxes import Target, boxes_of
from .dtensorspec import is_dtensor
from .jsonenc import loads
from .shard import BLOCKS_KEY, FINE_KEY, ITEMSIZE, TORCH_DTYPES, VERIFY_BLOCK
from .sharding import Sharded, cover, runs
from .shardread import Expected, Header, byte_view, check_blocks, digests_of, open_read, pread_exact

STATS = {"bytes": 0, "reads": 0, "needed": 0}
SMALL_RUN = 1024  # runs shorter than this (bytes) are read as whole rows when that wastes little
SLAB_WASTE = 2  # ... at most this many times the bytes needed


def load_sharded(directory: Path, shards: Sequence[dict[str, Any]], index: Mapping[str, Sharded],
                 where: Mapping[str, Target], expect: Callable[[int], Expected | None] | None = None,
                 mode: str = "stage", opened: Any = None,
                 boxes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]] | None = None) -> dict[str, Any]:
    """Every rank: read each tensor in `where` for this rank. `mode` "stage": into fresh memory,
    never into the live tensors (the caller copies once every rank has verified); "verify":
    read and check, keeping one box at a time and returning nothing; "live": straight into the
    live local tensors (CPU, contiguous), else through one fresh box per tensor copied in (the
    second pass of a restore too large to stage). `expect(rank)` gives shard `rank`'s digests:
    then every byte range read is widened to whole checksum blocks and verified. Returns
    {name: value} (a DTensor on the target's mesh, or a plain tensor). `opened`: see ShardFiles.
    `boxes`: `boxes_of(index, where)` as the caller's plan worked them out (`plan_reads`)."""
    files = ShardFiles(directory, shards, expect, opened)
    out: dict[str, Any] = {}
    boxes = boxes if boxes is not None else boxes_of(index, where)
    try:
        for name, target in where.items():
            tensor = index[name]
            shape, offset = boxes[name]
            dest, local = box_dest(target, tensor, tuple(shape), mode)
            read_box(files, tensor, tuple(offset), tuple(shape), dest)
            if mode != "verify":
                out[name] = box_value(dest, local, target, tensor)
    finally:
        files.close()
    return out

def box_dest(target: Target, tensor: Sharded, shape: tuple[int, ...], mode: str) -> tuple[Any, Any]:
    """(where this rank's box of `tensor` is read, the live local tensor it goes into or None):
    "live" mode with a live tensor: that tensor when it fits (`fits_box`), else fresh memory copied
    in by `box_value`; otherwise fresh memory (`empty_box`)."""
    local = target.live.to_local() if is_dtensor(target.live) else target.live
    into = mode == "live" and local is not None
    return (local if into and fits_box(local, shape, tensor.dtype) else empty_box(shape, tensor.dtype),
            local if into else None)

def box_value(dest: Any, local: Any, target: Target, tensor: Sharded) -> Any:
    """The state's value of a box read into `dest` (`box_dest`): the live tensor, `dest` copied
    into it unless read there; else `dest` as the target holds it (`wrap_box`)."""
    if local is None:
        return wrap_box(dest, target, tensor.shape)
    if dest is not local:
        local.copy_(dest)
    return target.live

def fits_box(t: Any, shape: tuple[Any, ...], dtype: str) -> bool:
    """Whether a box of `shape` and `dtype` can be read straight into the live local tensor `t`."""
    return (t.device.type == "cpu" and t.is_contiguous() and tuple(t.shape) == shape
            and t.dtype == TORCH_DTYPES[dtype])

def empty_box(shape: Any, dtype: str) -> Any:
    """Fresh CPU memory for a box (staging)."""
    import torch

    return torch.empty(tuple(shape), dtype=TORCH_DTYPES[dtype])

def wrap_box(local: Any, target: Target, global_shape: tuple[Any, ...]) -> Any:
    """A read box as what the live state holds there: a DTensor on the target's mesh (its device),
    or the plain tensor itself."""
    if target.mesh is None:
        return local
    import torch
    from torch.distributed.tensor import DTensor

    stride = tuple(math.prod(global_shape[d + 1:]) for d in range(len(global_shape)))
    return DTensor.from_local(local.to(target.mesh.device_type), target.mesh, target.placements,
                              run_check=False, shape=torch.Size(global_shape), stride=stride)

class ShardFiles:
    """Open shards and their checked headers, opened on first use only (through `opened`, an
    opened.OpenShards, when given: a restore's files stay open from its plan to its last read,
    and `close` leaves them to it)."""

    def __init__(self, directory: Path, shards: Sequence[dict[str, Any]],
                 expect: Callable[[int], Expected | None] | None = None, opened: Any = None) -> None:
        self.directory, self.shards, self.opened = directory, shards, opened
        self.open: dict[int, tuple[int, dict[str, Any], int]] = {}
        self.owned: list[int] = []  # fds opened here (not through `opened`): closed by `close`
        self.expect = expect
        self.expected: dict[int, Expected | None] = {}
        self.fine: dict[int, dict[str, tuple[list[str], int, int]]] = {}

    def digests(self, rank: int, name: str) -> tuple[list[str], int, int] | None:
        """(digests, dim, width) of tensor `name` in shard `rank`: the header's fine stripes when it
        has them (the header itself is verified), else the manifest's VERIFY_BLOCK byte blocks
        as (digests, 0, 0); None when not verifying."""
        exp = self.expected.get(rank)
        if exp is None:
            return None
        fine = self.fine.get(rank, {}).get(name)
        if fine is not None:
            return fine
        return self.manifest_digests(rank, name), 0, 0

    def manifest_digests(self, rank: int, name: str) -> list[str]:
        """Tensor `name`'s VERIFY_BLOCK digests in shard `rank`: its verified header's when it
        carries them, else its index's (opened when first asked)."""
        exp = self.expected[rank]
        assert exp is not None  # only asked while verifying
        return digests_of(exp, self.open[rank][1], name, self.directory / self.shards[rank]["file"])

    def stripes_only(self, rank: int, name: str) -> bool:
        """Whether shard `rank`'s header carries block digests (shard.BLOCKS_KEY) but not for
        `name`: its fine stripes are then its only digests outside the index, and a whole piece
        striped across its rows is read by them too (no index file opened)."""
        header = self.open[rank][1]
        meta = header.get("__metadata__")
        return (isinstance(meta, dict) and BLOCKS_KEY in meta and isinstance(header, Header)
                and name not in header.blocks(self.directory))

    def piece(self, rank: int, tensor: Sharded, shape: tuple[Any, ...]) -> tuple[int, int, Path]:
        """(fd, file offset of the piece's data, path), after checking its header entry."""
        if rank not in self.open:
            s = self.shards[rank]
            self.expected[rank] = self.expect(rank) if self.expect is not None else None
            fd, header, start, owned = open_read(self.directory, s["file"], s["bytes"], self.expected[rank],
                                                 self.opened)
            self.open[rank] = (fd, header, start)
            if owned:
                self.owned.append(fd)
            self.fine[rank] = _fine_blocks(self.open[rank][1], self.directory / s["file"])
        fd, header, start = self.open[rank]
        path = self.directory / self.shards[rank]["file"]
        info = header.get(tensor.name)
        if not isinstance(info, dict) or info.get("dtype") != tensor.dtype or tuple(info.get("shape", ())) != shape:
            raise CorruptCheckpointError(f"shard {path} does not hold the {tensor.dtype} {list(shape)} piece of "
                                         f"{tensor.name!r} that the manifest lists")
        return fd, start + int(info["data_offsets"][0]), path

    def close(self) -> None:
        for fd in self.owned:
            os.close(fd)
        self.owned.clear()
        self.open.clear()

def _fine_blocks(header: dict[str, Any], path: Path) -> dict[str, tuple[list[str], int, int]]:
    """The header's fine digests ({name: (digests, dim, width)}). The header is verified, so an
    entry this version does not understand (another writer's layout) is skipped, not corrupt:
    reads of that tensor fall back to the manifest's VERIFY_BLOCK digests."""
    meta = header.get("__metadata__")
    raw = meta.get(FINE_KEY) if isinstance(meta, dict) else None
    data = loads(raw, f"fine digests of {path}") if isinstance(raw, str) else None
    out: dict[str, tuple[list[str], int, int]] = {}
    if not isinstance(data, dict):
        return out
    for name, entry in data.items():
        info = header.get(name) if name != "__metadata__" else None
        shape = info.get("shape") if isinstance(info, dict) else None
        fields = entry if isinstance(entry, dict) else {}
        dim, width, digests = fields.get("dim"), fields.get("width"), fields.get("xxh3")
        if (not isinstance(shape, list) or not isinstance(dim, int) or not isinstance(width, int)
                or isinstance(dim, bool) or isinstance(width, bool) or not 0 <= dim < len(shape) or width <= 0
                or not isinstance(shape[dim], int) or not isinstance(digests, list)
                or not all(isinstance(d, str) and len(d) == 16 for d in digests)
                or len(digests) != -(-shape[dim] // width)):
            continue
        out[name] = (digests, dim, width)
    return out

def read_box(files: ShardFiles, tensor: Sharded, offset: tuple[Any, ...], shape: tuple[Any, ...], dest: Any) -> None:
    """Fill `dest` (CPU, `shape`) with the global box at `offset`, from the pieces covering it."""
    import torch

    size = ITEMSIZE[tensor.dtype]
    for piece, lo, box in cover(tensor, offset, shape):
        STATS["needed"] += math.prod(box) * size
        fd, start, path = files.piece(piece.rank, tensor, piece.shape)
        rel = tuple(a - o for a, o in zip(lo, piece.offset))
        dst = dest[tuple(slice(a - r, a - r + n) for a, r, n in zip(lo, offset, box))]
        row = math.prod(piece.shape[1:])
        check = files.digests(piece.rank, tensor.name)
        if check is not None and check[1] > 0 and (box[check[1]] < piece.shape[check[1]]
                                                   or files.stripes_only(piece.rank, tensor.name)):
            _read_striped(fd, start, path, tensor.name, check, piece.shape, rel, box, dst, size)  # across rows
            continue
        if check is not None:  # byte blocks: fine runs of rows, else the manifest's VERIFY_BLOCK
            fine = check[1] == 0 and check[2] > 0
            block = check[2] * math.prod(piece.shape[1:]) * size if fine else VERIFY_BLOCK
            digests = check[0] if fine else files.manifest_digests(piece.rank, tensor.name)
            _read_verified(fd, start, path, tensor.name, (digests, block), piece.shape, rel, box, dst, size)
            continue
        length, starts = runs(piece.shape, rel, box)
        if length * size < SMALL_RUN and len(box) > 1 and box[0] * row <= SLAB_WASTE * math.prod(box):
            slab = torch.empty((box[0], *piece.shape[1:]), dtype=dest.dtype)
            _pread(fd, byte_view(slab), start + rel[0] * row * size, path)
            cols = tuple(slice(r, r + n) for r, n in zip(rel[1:], box[1:]))
            dst.copy_(slab[(slice(None),) + cols])
            continue
        tmp = dst if dst.is_contiguous() else torch.empty(box, dtype=dest.dtype)
        view, pos, step = byte_view(tmp), 0, length * size
        for first in starts:
            _pread(fd, view[pos:pos + step], start + first * size, path)
            pos += step
        if tmp is not dst:
            dst.copy_(tmp)

def _read_verified(fd: int, start: int, path: Path, name: str, check: tuple[list[str], int], shape: tuple[Any, ...],
                   rel: tuple[Any, ...], box: tuple[Any, ...], dst: Any, size: int) -> None:
    """Verified read of one piece's box: the rows it spans, widened to whole checksum blocks
    (`check`: digests and block size), are read into fresh memory and checked before the box is
    copied into `dst`. For dim-0 pieces with fine (row-aligned) blocks that is the run itself
    plus at most a block at each end; a box narrower than the rows (Shard(1) restored as
    Shard(0), ...) reads the whole rows it spans."""
    import torch

    digests, block = check
    row_bytes = math.prod(shape[1:]) * size
    total = math.prod(shape) * size
    if len(digests) != -(-total // block):
        raise CorruptCheckpointError(f"shard {path}: the manifest records {len(digests)} checksum blocks for "
                                     f"tensor {name!r}, its {total} bytes need {-(-total // block)}")
    r0, n0 = (rel[0], box[0]) if shape else (0, 1)
    lo, hi = r0 * row_bytes, (r0 + n0) * row_bytes
    first, last = lo // block, -(-hi // block)
    begin, end = first * block, min(last * block, total)
    raw = torch.empty(end - begin, dtype=torch.uint8)
    view = byte_view(raw)
    step = max(1, VERIFY_BLOCK // block) * block  # fine blocks: one read per VERIFY_BLOCK or so
    for i in range(0, len(view), step):  # hash each read while it is in cache
        _pread(fd, view[i : i + step], start + begin + i, path)
        check_blocks(view[i : i + step], first + i // block, digests, path, name, block)
    rows = raw[lo - begin : hi - begin].view(dst.dtype)
    if not shape:
        dst.copy_(rows.reshape(()))
        return
    rows = rows.reshape((n0, *shape[1:]))
    dst.copy_(rows[(slice(None),) + tuple(slice(r, r + n) for r, n in zip(rel[1:], box[1:]))])

def _read_striped(fd: int, start: int, path: Path, name: str, check: tuple[list[str], int, int],
                  shape: tuple[Any, ...], rel: tuple[Any, ...], box: tuple[Any, ...], dst: Any, size: int) -> None:
    """Verified read of one piece's box when its fine digests are stripes along dimension
    `dim` >= 1 (a Shard(1) piece): each stripe the box touches is read as its runs (whole along
    the other dimensions), checked, and its part of the box copied into `dst`."""
    import torch

    digests, dim, width = check
    if tuple(box) == tuple(shape):  # the whole piece: one read, each stripe hashed from a copy of it
        if len(digests) != -(-shape[dim] // width):
            raise CorruptCheckpointError(f"shard {path}: tensor {name!r} has {len(digests)} stripe digests")
        whole = torch.empty(tuple(shape), dtype=dst.dtype)
        _pread(fd, byte_view(whole), start, path)
        for k, digest in enumerate(digests):
            part = whole.narrow(dim, k * width, min(width, shape[dim] - k * width))
            if xxhash.xxh3_64_hexdigest(byte_view(part.contiguous())) != digest:
                raise CorruptCheckpointError(f"shard {path}: tensor {name!r} fails its checksum in stripe {k} "
                                             f"(indices {k * width}.. of dimension {dim}; flipped bits?)")
        dst.copy_(whole)
        return
    lo, hi = rel[dim], rel[dim] + box[dim]
    for k in range(lo // width, -(-hi // width)):
        c0, c1 = k * width, min((k + 1) * width, shape[dim])
        s_rel = tuple(c0 if d == dim else 0 for d in range(len(shape)))
        s_box = tuple(c1 - c0 if d == dim else n for d, n in enumerate(shape))
        stripe = torch.empty(s_box, dtype=dst.dtype)
        view, pos = byte_view(stripe), 0
        length, starts = runs(shape, s_rel, s_box)
        for first in starts:
            _pread(fd, view[pos : pos + length * size], start + first * size, path)
            pos += length * size
        if xxhash.xxh3_64_hexdigest(view) != digests[k]:
            raise CorruptCheckpointError(f"shard {path}: tensor {name!r} fails its checksum in stripe {k} "
                                         f"(indices {c0}..{c1} of dimension {dim}; flipped bits?)")
        a, b = max(lo, c0), min(hi, c1)
        src = tuple(slice(a - c0, b - c0) if d == dim else slice(r, r + n) for d, (r, n) in enumerate(zip(rel, box)))
        out = tuple(slice(a - lo, b - lo) if d == dim else slice(None) for d in range(len(shape)))
        dst[out].copy_(stripe[src])

def _pread(fd: int, view: memoryview, offset: int, path: Path) -> None:
    pread_exact(fd, view, offset, path)
    STATS["bytes"] += len(view)
    STATS["reads"] += 1

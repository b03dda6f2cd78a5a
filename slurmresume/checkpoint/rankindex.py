"""Format 2's per-rank tensor index: `rank-NNNNN.index.json` beside each rank's shard.

Format 1 listed every rank's tensors (names, shapes, block digests, global offsets) in the one
manifest: it grew with ranks x tensors and crossed the reader's cap at a few hundred ranks. In
format 2 each rank writes its own entries into its index file, fsynced with its shard (the
caller fsyncs the directory once for both), and sends rank 0 only a fixed-size record: the
file's size and xxh3, which the manifest lists, so that the manifest's checksum (pinned by the
marker) covers every index file. A reader opens only the index files of the ranks it reads.

    {"format": "slurmresume/2", "rank": 3, "file": "rank-00003-of-00008.safetensors",
     "tensors": {NAME: {"dtype", "shape", "xxh3": [block digests], "global_shape"?, "global_offset"?}}}
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from itertools import chain
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError
from . import fsio
from .bounded import read_bounded
from .jsonenc import dumps, loads
from .layout import FORMAT, index_name, is_plain_shard_name

_INT, _STR, _SIXTEEN, _LIST = {int}, {str}, {16}, {list}  # exact types from JSON; a digest's 16 hex digits
MAX_INDEX = 64 << 20  # one rank's tensors: a header's worth (shard.MAX_HEADER) plus block digests


def placed(index: dict[str, Any], specs: dict[str, Any]) -> dict[str, Any]:
    """The index entries with where each DTensor piece sits in its global tensor (from the
    skeleton's specs)."""
    return {n: {**e, "global_shape": specs[n]["shape"], "global_offset": specs[n]["offset"]} if n in specs else e
            for n, e in index.items()}


def index_bytes(rank: int, file: str, tensors: dict[str, Any]) -> bytes:
    raw = dumps({"format": FORMAT, "rank": rank, "file": file, "tensors": tensors}).encode()
    if len(raw) > MAX_INDEX:  # never write (and commit) what the reader refuses
        raise CorruptCheckpointError(f"the tensor index of rank {rank} would be {len(raw)} bytes ({len(tensors)} "
                                     f"tensors), over the {MAX_INDEX}-byte index read cap of this version")
    return raw


def write_index(directory: Path, rank: int, file: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """Every rank, after its shard: write its index durably, except for the directory fsync the
    caller does once for shard and index. Returns what the manifest records of it."""
    raw = index_bytes(rank, file, tensors)
    name = index_name(rank)
    fsio.write_durable(directory / name, raw, "index", sync_dir=False)
    return {"index": name, "index_bytes": len(raw), "index_xxh3": xxhash.xxh3_64_hexdigest(raw)}


def read_index(step_dir: Path, shard: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Rank `shard["rank"]`'s tensor entries {name: info}, after checking the file against the
    digest the manifest records for it (CorruptCheckpointError naming the file otherwise)."""
    path = step_dir / shard["index"]
    if "@" in shard["index"]:  # per-node layout: the index follows the rank's shard in its range (nodefile)
        raw = _read_range(step_dir, shard["index"], shard["index_bytes"])
    else:
        raw = read_bounded(path, MAX_INDEX, "tensor index")
    if len(raw) != shard["index_bytes"] or xxhash.xxh3_64_hexdigest(raw) != shard["index_xxh3"]:
        raise CorruptCheckpointError(f"tensor index {path} does not match the manifest (damaged or replaced)")
    return index_entries(raw, shard["rank"], shard["file"], path)


def index_entries(raw: bytes, rank: int, file: str, path: Path) -> dict[str, dict[str, Any]]:
    """Rank `rank`'s tensor entries {name: info} from its index file's bytes `raw`, the index naming
    that rank and its shard `file`, each entry's block digests well formed (CorruptCheckpointError
    naming the file otherwise). `read_index` first checks the bytes against the manifest; a memory
    snapshot's shard read before its commit (train/memshard.py) has no manifest yet."""
    data = loads(raw, f"tensor index {path}")
    if not (isinstance(data, dict) and data.get("rank") == rank and data.get("file") == file
            and isinstance(data.get("tensors"), dict)):
        raise CorruptCheckpointError(f"tensor index {path} is not rank {rank}'s index")
    tensors: dict[str, dict[str, Any]] = data["tensors"]
    lists: list[Any] = [info.get("xxh3") if type(info) is dict else None for info in tensors.values()]
    if set(map(type, lists)) <= _LIST:  # every entry's digests at once (405B: 3,411 entries a plan) ...
        flat = list(chain.from_iterable(lists))
        if set(map(type, flat)) <= _STR and set(map(len, flat)) <= _SIXTEEN:
            return tensors
    for name, info in tensors.items():  # ... else the entry to name
        digests = info.get("xxh3") if type(info) is dict else None
        if type(digests) is not list or not (set(map(type, digests)) <= _STR and set(map(len, digests)) <= _SIXTEEN):
            raise CorruptCheckpointError(f"tensor index {path}: tensor {name!r} has a malformed entry")
    return tensors


def check_pieces(entries: dict[str, dict[str, Any]], rank: int, world: int, specs: dict[str, Any],
                 placed: bool = False) -> None:
    """The DTensor pieces of rank `rank`'s index: each a box inside its global shape that agrees
    with the manifest's spec of its tensor (dtype, global shape) and, where the manifest places
    pieces by arithmetic, one that the placements give. CorruptCheckpointError otherwise: a
    restore that reads this rank refuses before a byte of its data is used. `placed`: every spec
    is known to place by arithmetic (`Manifest.placed_by_arithmetic`), not asked again per entry:
    then an entry that is exactly its expected piece (exact ints, the box computed once per
    distinct global shape and layout: a model's layers repeat a few shapes) passes on a few
    comparisons, and any other gets the full checks below (and their error)."""
    expected: dict[tuple[Any, ...], tuple[list[int], list[int]]] = {}
    passed: list[list[Any]] = []  # the int lists of the entries that matched their piece: exact ints?
    for name, info in entries.items():
        if "global_offset" not in info and "global_shape" not in info:
            continue
        spec = specs.get(name)
        if placed and spec is not None:
            glob, mesh, placements = spec["shape"], spec["mesh_shape"], spec["placements"]
            key = (len(glob), *glob, *mesh, *placements)  # mesh and placements: of one length (arithmetic)
            box = expected.get(key)
            if box is None:
                box = expected[key] = _expected_piece(rank, (tuple(glob), tuple(mesh), tuple(placements)))
            offset, shape, global_shape = info.get("global_offset"), info.get("shape"), info.get("global_shape")
            if (offset == box[0] and shape == box[1] and global_shape == glob
                    and info.get("dtype") == spec.get("dtype")):
                passed += (offset, shape, global_shape)
                continue
        _check_piece(name, info, rank, world, spec, placed)
    if passed and not _exact(list(chain.from_iterable(passed))):  # a 1.0 or True equal to its int: ...
        for name, info in entries.items():  # ... the full checks find it (and name it)
            if "global_offset" in info or "global_shape" in info:
                _check_piece(name, info, rank, world, specs.get(name), placed)


def _exact(values: list[Any]) -> bool:
    """A list of ints from JSON (not floats or bools that compare equal to them)."""
    return set(map(type, values)) <= _INT


def _expected_piece(rank: int, key: tuple[Any, ...]) -> tuple[list[int], list[int]]:
    """[global offset], [shape] of rank `rank`'s piece of a tensor of global shape key[0] on a
    row-major mesh key[1] with placements key[2] (placement.local_box)."""
    from .placement import local_box

    offset, shape = local_box(key[0], key[1], _coordinate(rank, list(key[1])), key[2])
    return list(offset), list(shape)


def _check_piece(name: str, info: dict[str, Any], rank: int, world: int, spec: Any, placed: bool) -> None:
    from .placement import arithmetic, local_box
    from .sharding import piece_of

    piece = piece_of(name, rank, info, world)
    if spec is None:
        return
    if info.get("dtype") != spec.get("dtype") or list(info.get("global_shape") or ()) != spec.get("shape"):
        raise CorruptCheckpointError(f"pieces of tensor {name!r} disagree: rank {rank}'s index says "
                                     f"{info.get('dtype')} {info.get('global_shape')}, the manifest "
                                     f"{spec.get('dtype')} {spec.get('shape')}")
    if not (placed or arithmetic(spec, world)):
        return
    mesh = tuple(spec["mesh_shape"])
    if (piece.offset, piece.shape) != local_box(tuple(spec["shape"]), mesh, _coordinate(rank, spec["mesh_shape"]),
                                                tuple(spec["placements"])):  # O(1): its own box
        raise CorruptCheckpointError(f"tensor {name!r}: rank {rank}'s piece at {list(piece.offset)} of shape "
                                     f"{list(piece.shape)} disagrees with the placements {spec['placements']} "
                                     "in the manifest")


def _read_range(step_dir: Path, locator: str, size: int) -> bytes:
    from .shardread import open_checked, pread_exact

    if size > MAX_INDEX:
        raise CorruptCheckpointError(f"tensor index {step_dir / locator} claims {size} bytes, over the "
                                     f"{MAX_INDEX}-byte index read cap of this version")
    buf = bytearray(size)
    fd = open_checked(step_dir, locator, size)
    try:
        pread_exact(fd, memoryview(buf), int(locator.partition("@")[2]), step_dir / locator)
    finally:
        os.close(fd)
    return bytes(buf)


def _coordinate(rank: int, mesh: list[int]) -> tuple[int, ...]:
    """Rank `rank`'s coordinate on a row-major mesh of shape `mesh` over ranks 0..W-1."""
    out = []
    for n in reversed(mesh):
        rank, c = divmod(rank, n)
        out.append(c)
    return tuple(reversed(out))


def check_shard_entry(s: dict[str, Any], rank: int) -> str | None:
    """Why format 2's index fields of manifest shard entry `rank` are malformed, else None."""
    index = s.get("index")
    in_node = isinstance(index, str) and "@" in index and is_plain_shard_name(index)
    if index != index_name(rank) and not in_node:
        return f"shard {rank}'s index file is {s.get('index')!r}, not {index_name(rank)!r}"
    size, digest = s.get("index_bytes"), s.get("index_xxh3")
    if not (isinstance(size, int) and not isinstance(size, bool) and size > 0):
        return f"shard {rank}'s index size {size!r} is not a byte count"
    if not (isinstance(digest, str) and len(digest) == 16):
        return f"shard {rank}'s index has no valid checksum"
    return None


class IndexDigests(Mapping[str, list[str]]):
    """One shard's block digests by tensor name, from `entries()` (its index's entries, read and
    checked: `Manifest.rank_tensors`) on the first lookup only: a read that checks every piece
    by its header's finer digests never opens the index file."""

    def __init__(self, entries: Callable[[], dict[str, dict[str, Any]]]) -> None:
        self._entries = entries
        self._blocks: dict[str, list[str]] | None = None

    def _load(self) -> dict[str, list[str]]:
        if self._blocks is None:
            self._blocks = {n: t["xxh3"] for n, t in self._entries().items() if "xxh3" in t}
        return self._blocks

    def __getitem__(self, name: str) -> list[str]:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

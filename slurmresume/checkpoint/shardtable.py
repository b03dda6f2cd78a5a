"""Format 3's per-shard table: parallel columns, not one JSON object per rank.

Format 2 listed each shard as an object {"file", "rank", "bytes", "xxh3", "header_xxh3", "index",
"index_bytes", "index_xxh3"}: at 16,384 ranks the parse alone built 16,384 dicts (~37 ms) that a
restoring rank, which reads one shard or a few, never looks at. Format 3 keeps the same facts as
columns, each checked as a whole (C loops: types, ranges, hex digits):

    "shards": {"bytes": [N, ...], "xxh3": "<16 hex digits per shard, in rank order>",
               "header_xxh3": "...", "index_bytes": [N, ...], "index_xxh3": "...",
               "file": [...], "index": [...]}

"file" and "index" are written only when some name is not the per-rank default derived from the
rank (rank-NNNNN-of-WWWWW.safetensors, rank-NNNNN.index.json), e.g. the per-node layout's ranges
"node-NNNNN.bin@OFFSET". `ShardTable` gives rank r's row, the dict format 2 listed, when asked,
and builds no other.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any, overload

from .layout import index_name, is_plain_shard_name, shard_name

DIGESTS = ("xxh3", "header_xxh3", "index_xxh3")  # 16 hex digits per shard, concatenated
COLUMNS = ("bytes", *DIGESTS, "index_bytes", "file", "index")
_HEX = re.compile(r"[0-9a-f]*")


def columns(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Writer: the columns of shard rows in rank order (each with "file", "bytes", "xxh3",
    "header_xxh3", "index", "index_bytes", "index_xxh3"). Also how a test edits a format-3
    manifest: `rows`, edit one row, `columns` again."""
    world = len(rows)
    out: dict[str, Any] = {"bytes": [r.get("bytes") for r in rows], "index_bytes": [r.get("index_bytes") for r in rows]}
    for key in DIGESTS:  # a wrong-length digest stays wrong: the joined column's length tells
        out[key] = "".join(d if isinstance(d, str) else "?" for d in (r.get(key) for r in rows))
    if any(r.get("file") != shard_name(i, world) for i, r in enumerate(rows)):
        out["file"] = [r.get("file") for r in rows]
    if any(r.get("index") != index_name(i) for i, r in enumerate(rows)):
        out["index"] = [r.get("index") for r in rows]
    return out


def total(shards: Any) -> int:
    """The bytes of every shard, from a manifest's shard table as written (any format)."""
    return sum(shards["bytes"]) if isinstance(shards, dict) else sum(s["bytes"] for s in shards)


def rows(table: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Every row of a (checked) table: for tools and tests; a restore asks `ShardTable[r]`."""
    return list(ShardTable(table, world))


def problem(table: Any, world: int) -> str | None:
    """Why a format-3 shard table is malformed, else None: W sizes of at least 8 bytes, W positive
    index sizes, W digests of 16 lowercase hex digits per digest column, and listed names (when
    listed) plain, distinct and each rank's own index."""
    if not isinstance(table, dict):
        return "the shard table is not an object of columns"
    sizes = table.get("bytes")
    if not isinstance(sizes, list):
        return f"the shard table has an invalid size column {str(sizes)[:40]!r}"
    if len(sizes) != world:
        return f"expected {world} shards (the size column has {len(sizes)})"
    if not all(type(b) is int for b in sizes) or min(sizes) < 8:
        i = next(i for i, b in enumerate(sizes) if type(b) is not int or b < 8)
        return f"shard {_name(table, i, world)} has an invalid size {sizes[i]!r}"
    if unknown := set(table) - set(COLUMNS):
        return f"the shard table has unknown columns {sorted(unknown)}"
    for key, what in (("xxh3", "checksum"), ("header_xxh3", "header checksum"), ("index_xxh3", "index checksum")):
        col = table.get(key)
        if not (isinstance(col, str) and len(col) == 16 * world and _HEX.fullmatch(col)):
            return f"the shard table has no valid {what} of each of its {world} shards"
    sizes = table.get("index_bytes")
    if not (isinstance(sizes, list) and len(sizes) == world and all(type(b) is int for b in sizes)
            and min(sizes) > 0):
        return f"the shard table has no valid index size of each of its {world} shards"
    return _names_problem(table, world)


def _names_problem(table: dict[str, Any], world: int) -> str | None:
    files, indexes = table.get("file"), table.get("index")
    if files is not None:
        if not isinstance(files, list) or len(files) != world:
            return f"expected {world} shard file names"
        for name in files:
            if not is_plain_shard_name(name):
                return f"shard name {name!r} is not a plain shard file name (no '/', no '..')"
        if len(set(files)) != world:
            return "two shard entries name the same file"
    if indexes is not None:
        if not isinstance(indexes, list) or len(indexes) != world:
            return f"expected {world} index file names"
        for rank, name in enumerate(indexes):
            in_node = isinstance(name, str) and "@" in name and is_plain_shard_name(name)
            if name != index_name(rank) and not in_node:
                return f"shard {rank}'s index file is {name!r}, not {index_name(rank)!r}"
    return None


def _name(table: dict[str, Any], rank: int, world: int) -> str:
    files = table.get("file")
    return str(files[rank]) if isinstance(files, list) and rank < len(files) else shard_name(rank, world)


class ShardTable(Sequence[dict[str, Any]]):
    """A checked format-3 table read as format 2's list of rows: `table[r]` builds rank r's row
    (and caches it); `built` says which rows were built (a same-W restore builds its own and 0's)."""

    def __init__(self, table: dict[str, Any], world: int) -> None:
        self._t, self._world = table, world
        self.built: dict[int, dict[str, Any]] = {}

    def __len__(self) -> int:
        return self._world

    @property
    def total_bytes(self) -> int:
        return sum(self._t["bytes"])

    @overload
    def __getitem__(self, rank: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, rank: slice) -> list[dict[str, Any]]: ...

    def __getitem__(self, rank: int | slice) -> Any:
        if isinstance(rank, slice):
            return [self[i] for i in range(*rank.indices(self._world))]
        if rank < 0:
            rank += self._world
        if not 0 <= rank < self._world:
            raise IndexError(f"shard {rank} of {self._world}")
        row = self.built.get(rank)
        if row is None:
            t, a, b = self._t, 16 * rank, 16 * rank + 16
            files, indexes = t.get("file"), t.get("index")
            row = {"file": files[rank] if files is not None else shard_name(rank, self._world), "rank": rank,
                   "bytes": t["bytes"][rank], "xxh3": t["xxh3"][a:b], "header_xxh3": t["header_xxh3"][a:b],
                   "index": indexes[rank] if indexes is not None else index_name(rank),
                   "index_bytes": t["index_bytes"][rank], "index_xxh3": t["index_xxh3"][a:b]}
            self.built[rank] = row
        return row

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self[i] for i in range(self._world))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ShardTable):
            return self._world == other._world and self._t == other._t
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # type: ignore[assignment]

"""What each manifest format says beyond the shard table, checked (anyone) and built (coordinator).

Format 1 lists every rank's tensors in the manifest itself (`check_v1`); format 2 lists each
DTensor once (dtype, global shape, placements) and keeps each rank's tensors in its own index file
(`check_once`); format 3, written now (`build_manifest` from every rank's fixed-size record), is
format 2 with the shard table as columns (shardtable.py).
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import CorruptCheckpointError
from .layout import FORMAT
from .shard import VERIFY_BLOCK


def build_manifest(step: int, reports: list[dict[str, Any]], metrics: Any, meta: Any) -> dict[str, Any]:
    """Rank 0: the format-3 manifest from every rank's fixed-size record (ordered by rank): per
    shard its size and checksums and its index file's, as columns (names only where they are not
    the per-rank ones); each DTensor's dtype, global shape
    and placements once (from rank 0's record); the names stored once, in shard 0; "pieces_listed"
    when some rank holds a DTensor those placements do not give (its pieces: in the index files)."""
    from .shardtable import columns

    shards = columns([{k: rep[k] for k in _SHARD_KEYS} for rep in sorted(reports, key=lambda r: r["rank"])])
    first = next(r for r in reports if r["rank"] == 0)
    now = time.time()
    return {
        "format": FORMAT,
        "step": step,
        "world_size": len(reports),
        "created": now,
        "created_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        "verify_block": VERIFY_BLOCK,
        "shards": shards,
        "sharded": first.get("sharded") or {},
        "replicated": list(first.get("replicated") or ()),
        "elastic": not any(r.get("pinned") for r in reports),
        **({"pieces_listed": True} if any(r.get("listed") for r in reports) else {}),
        "metrics": metrics,
        "meta": meta,
    }


_SHARD_KEYS = ("file", "rank", "bytes", "xxh3", "header_xxh3", "index", "index_bytes", "index_xxh3")


def check_once(data: dict[str, Any]) -> None:
    """Format 2's per-tensor section: each DTensor once (dtype, global shape, placements), the
    names stored once in shard 0, and whether another world size may load the step."""
    from .sharding import check_placements, check_shape

    sharded, shared = data.get("sharded"), data.get("replicated")
    if not isinstance(sharded, dict):
        raise CorruptCheckpointError("the DTensor section 'sharded' is not an object")
    for name, spec in sharded.items():
        what = f"DTensor {name!r}"
        if not isinstance(spec, dict) or not isinstance(spec.get("dtype"), str):
            raise CorruptCheckpointError(f"{what} has no valid dtype")
        shape = check_shape(spec.get("shape"), what)
        check_placements(spec.get("placements"), len(shape), what)
    if not isinstance(shared, list) or not all(isinstance(n, str) for n in shared):
        raise CorruptCheckpointError("'replicated' is not a list of tensor names")
    if not isinstance(data.get("elastic"), bool):
        raise CorruptCheckpointError("'elastic' is not true or false")
    if data.get("pieces_listed", False) is not True and "pieces_listed" in data:
        raise CorruptCheckpointError("'pieces_listed' is not true")


def check_v1(data: dict[str, Any], world: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Format 1: the manifest lists every rank's tensors; checked (DTensor pieces too) here.
    Returns the tensor list and name -> sharding.Sharded."""
    tensors = data.get("tensors")
    if not isinstance(tensors, list):
        raise CorruptCheckpointError("tensor index is missing")
    for t in tensors:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise CorruptCheckpointError("a tensor index entry is not an object with a name")
        digests = t.get("xxh3")
        if digests is not None and not (isinstance(digests, list)
                                        and all(isinstance(d, str) and len(d) == 16 for d in digests)):
            raise CorruptCheckpointError(f"tensor {t.get('name')!r} has malformed checksums")
    from .sharding import index_pieces

    return tensors, index_pieces(tensors, world)


def shard_problem(shards: list[Any], v2: bool) -> str | None:
    """Why a format-1/2 per-shard table (one entry per rank, in rank order) is malformed, else
    None: a plain file name each, distinct, a size, the checksums, and (format 2) its index file's.
    Format 3's columns: shardtable.problem."""
    from .layout import is_plain_shard_name
    from .marker import is_int
    from .rankindex import check_shard_entry

    for i, s in enumerate(shards):
        if not isinstance(s, dict) or s.get("rank") != i:
            return f"shard entry {i} is malformed"
        if not is_plain_shard_name(s.get("file")):
            return f"shard name {s.get('file')!r} is not a plain shard file name (no '/', no '..')"
        if not is_int(s.get("bytes")) or s["bytes"] < 8:
            return f"shard {s.get('file')} has an invalid size {s.get('bytes')!r}"
        if not (isinstance(s.get("xxh3"), str) and len(s["xxh3"]) == 16):
            return f"shard {s.get('file')} has no valid checksum"
        if "header_xxh3" in s and not (isinstance(s["header_xxh3"], str) and len(s["header_xxh3"]) == 16):
            return f"shard {s.get('file')} has a malformed header checksum"
        if v2 and (why := check_shard_entry(s, i)):
            return why
    if len({s["file"] for s in shards}) != len(shards):
        return "two shard entries name the same file"
    return None

"""manifest.json: reading and validating it (anyone), and what a reader of this version accepts.

Split by job: the commit marker and the format string live in `marker.py`, each format's own
sections (format 1's tensor list, format 2's DTensor specs, the coordinator's build) in
`formats.py`; the names callers import from here are re-exported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError, UnsafeCheckpointError
from . import jsonenc
from .bounded import read_bounded as read_bounded  # re-exported: the mirror reads through it
from .formats import build_manifest as build_manifest
from .formats import check_once, check_v1, shard_problem
from .jsonenc import loads
from .layout import FORMATS_READ, MANIFEST, MARKER
from .marker import MAX_MARKER as MAX_MARKER
from .marker import MarkerFacts as MarkerFacts
from .marker import check_marker as check_marker
from .marker import format_version as format_version
from .marker import is_int, says_newer
from .marker import marker_bytes as marker_bytes
from .marker import marker_facts as marker_facts
from .marker import newer_format as newer_format
from .marker import pinned_manifest as pinned_manifest
from .marker import refuse_newer as refuse_newer
from .marker import refuse_newer_marker as refuse_newer_marker
from .rankindex import IndexDigests
from .shard import VERIFY_BLOCK
from .shardread import Expected
from .shardtable import ShardTable
from .shardtable import problem as table_problem

MAX_MANIFEST = 64 << 20
MAX_TIME = 1e11  # epoch seconds (year 5138): what time.strftime and datetime can render


def manifest_cap() -> int:
    """The largest manifest every reader of this version accepts: the manifest read cap and the
    JSON parser's own cap, whichever is smaller (read at call time: tests lower them)."""
    return min(MAX_MANIFEST, jsonenc.MAX_JSON_BYTES)


def over_cap(step: int, manifest_bytes: int, marker_bytes: int, world: int, tensors_once: int) -> str | None:
    """Pure: why a reader of this version would refuse a step with these sizes, else None. The
    coordinator asks before it writes the marker, so that a commit is a promise the step loads.
    (Format 2's manifest grows with ranks + tensors, no longer with ranks x tensors.)"""
    cap = manifest_cap()
    if manifest_bytes > cap:
        return (f"the manifest of step {step} would be {manifest_bytes} bytes ({world} ranks, {tensors_once} "
                f"tensors listed once), over the {cap}-byte manifest read cap of this version; "
                "save fewer, larger tensors (e.g. flatten parameter groups) or use fewer ranks")
    if marker_bytes > MAX_MARKER:
        return (f"the commit marker of step {step} would be {marker_bytes} bytes, over the {MAX_MARKER}-byte "
                "marker read cap of this version; record fewer or smaller metrics")
    return None


@dataclass
class Manifest:
    """A validated manifest, plus what the loader needs to trust it. Format 1 lists every rank's
    tensors itself (`listed`); format 2 keeps them in per-rank index files, read (and checked
    against the manifest) only when asked: `rank_tensors(r)` opens rank r's alone. `shards`: format
    1/2's list of rows, or format 3's `ShardTable`, which builds a rank's row only when asked."""

    step: int
    world_size: int
    created: float
    shards: Sequence[dict[str, Any]]
    metrics: Any
    meta: Any
    raw: dict[str, Any] = field(repr=False)
    directory: Path = field(default=Path("."), repr=False)
    listed: list[dict[str, Any]] | None = field(default=None, repr=False)  # format 1's tensor list
    _sharded: dict[str, Any] | None = field(default=None, repr=False)  # name -> sharding.Sharded (DTensors)
    _indexes: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)
    digest: str = ""  # xxh3 of the manifest's bytes as read (what the commit marker pins)
    # those bytes (read_manifest), kept for a restore: rank 0 sends them to the other ranks
    # (restoreload.share_manifest), which then never open the file, and drops them once sent
    raw_bytes: bytes | None = field(default=None, repr=False, compare=False)
    _arithmetic: bool | None = field(default=None, repr=False)
    _layouts: dict[str, Any] = field(default_factory=dict, repr=False)  # name -> (mesh shape, placements)

    @property
    def total_bytes(self) -> int:
        if isinstance(self.shards, ShardTable):
            return self.shards.total_bytes
        return sum(s["bytes"] for s in self.shards)

    @property
    def version(self) -> int:
        return format_version(self.raw.get("format")) or 0

    @property
    def has_block_digests(self) -> bool:
        """Written with per-block tensor digests (every read verifiable as it happens); older
        checkpoints need the whole-shard checksum pass instead."""
        return self.raw.get("verify_block") == VERIFY_BLOCK and (  # format 3: a column, always written
            isinstance(self.shards, ShardTable) or all("header_xxh3" in s for s in self.shards))

    def rank_tensors(self, rank: int) -> dict[str, dict[str, Any]]:
        """Shard `rank`'s tensor entries {name: info}; format 2 reads and checks its index file
        (once per Manifest), and no other."""
        if self.listed is not None:
            return {t["name"]: t for t in self.listed if t.get("rank") == rank}
        if rank not in self._indexes:
            from .rankindex import check_pieces, read_index

            entries = read_index(self.directory, self.shards[rank])
            check_pieces(entries, rank, self.world_size, self.raw.get("sharded") or {}, self.placed_by_arithmetic)
            self._indexes[rank] = entries
        return self._indexes[rank]

    @property
    def tensors(self) -> list[dict[str, Any]]:
        """Every rank's tensor entries, as format 1 lists them ({"name", "rank", ...}). Format 2:
        reads every index file: for tools (inspect, export, compare), not for a restore."""
        if self.listed is not None:
            return self.listed
        shared = set(self.raw.get("replicated") or ())
        out = []
        for rank in range(self.world_size):
            for name, info in self.rank_tensors(rank).items():
                if rank and name in shared:  # a small replica's copy in every shard (replicas.everywhere): listed once
                    continue
                out.append({"name": name, "rank": rank, **info, **({"replicated": True} if rank == 0
                                                                      and name in shared else {})})
        return out

    @property
    def placed_by_arithmetic(self) -> bool:
        """Format 2 whose DTensors all come from one mesh over every rank: each rank derives
        every piece from the specs here (`sharded` reads no index file)."""
        from .placement import arithmetic

        if self._arithmetic is None:  # "pieces_listed": some rank holds a DTensor the specs do not place
            specs = self.raw.get("sharded") or {}
            placed = self.listed is None and self.raw.get("pieces_listed") is not True
            layouts: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {}
            prev: tuple[Any, Any, Any] = (None, None, None)  # (mesh, placements, layout) of the last spec asked
            for name, sp in specs.items() if placed else ():
                mesh, placements = sp.get("mesh_shape"), sp.get("placements")
                # thousands of specs, a few layouts, mostly in runs: the same lists as the last
                # spec (exact ints, a full-mesh arange) are placed as it was, without asking again
                if not (mesh == prev[0] and placements == prev[1] and type(mesh) is list and sp.get("mesh_arange") is True
                        and set(map(type, mesh)) <= {int}):
                    if not arithmetic(sp, self.world_size):
                        placed = False
                        break
                    prev = (mesh, placements, (tuple(mesh), tuple(placements)))
                layouts[name] = prev[2]
            self._arithmetic, self._layouts = placed, layouts if placed else {}
        return self._arithmetic

    @property
    def sharded(self) -> dict[str, Any]:
        """name -> sharding.Sharded: every saved piece of each DTensor (format 2: from every index)."""
        if self._sharded is None:
            from .sharding import Sharded, index_pieces

            specs = self.raw.get("sharded") or {}
            if self.placed_by_arithmetic:
                # format 2 from one full mesh: pieces by rank arithmetic, no index file read
                layouts = self._layouts
                self._sharded = {n: Sharded(n, sp["dtype"], tuple(sp["shape"]), (), layouts[n])
                                 for n, sp in specs.items()}
            else:
                self._sharded = index_pieces(self.tensors, self.world_size)
        return self._sharded

    @property
    def files(self) -> list[dict[str, Any]]:
        """Every file of the step besides manifest and marker, as {"file", "bytes", "xxh3", "rank"}:
        the shards and (format 2) their index files. What the mirror copies and `verify` hashes."""
        out = [{k: s[k] for k in ("file", "bytes", "xxh3", "rank")} for s in self.shards]
        if self.listed is None:
            out += [{"file": s["index"], "bytes": s["index_bytes"], "xxh3": s["index_xxh3"], "rank": s["rank"]}
                    for s in self.shards]
        return out

    @property
    def elastic(self) -> bool:
        """Whether another world size may load it (see replicas.elastic); format 2 records it."""
        if self.listed is None:
            return self.world_size == 1 or self.raw.get("elastic") is True
        from .replicas import elastic

        return elastic(self.listed, self.world_size)

    def expected(self, rank: int) -> Expected | None:
        """The digests a verified read of shard `rank` checks, or None for an older checkpoint: its
        header's from the manifest; its tensors' from its index file, read (`rank_tensors`) when
        first asked (a reshard reading a piece by the header's finer digests never asks)."""
        if not self.has_block_digests:
            return None
        return Expected(self.shards[rank]["header_xxh3"], IndexDigests(lambda: self.rank_tensors(rank)))


def read_manifest(step_dir: Path, expected_step: int | None = None, real_dir: bool = False) -> Manifest:
    """Read and validate manifest + marker of a step directory. Raises CorruptCheckpointError
    (or UnsafeCheckpointError) naming the file; UnreadableCheckpointError for a step written by
    a newer slurmresume or over this version's read caps (not corrupt); never reads outside
    `step_dir`. `real_dir`: the caller's lstat of `step_dir` found a directory (not asked again)."""
    if not real_dir and step_dir.is_symlink():  # its files would be read from wherever the link points
        raise UnsafeCheckpointError(f"refusing checkpoint {step_dir}: not a real directory (a symbolic link)")
    marker_raw = read_bounded(step_dir / MARKER, MAX_MARKER, "commit marker")
    marker = loads(marker_raw, f"commit marker {step_dir / MARKER}")
    raw = None
    if not says_newer(marker) or os.path.lexists(step_dir / MANIFEST):  # a newer layout may have none
        raw = read_bounded(step_dir / MANIFEST, manifest_cap(), "manifest")
    data = pinned_manifest(marker, raw, step_dir)
    manifest = validate_manifest(data, step_dir, expected_step)
    manifest.digest, manifest.raw_bytes = xxhash.xxh3_64_hexdigest(raw or b""), raw
    if marker.get("step") != manifest.step:
        raise CorruptCheckpointError(f"commit marker {step_dir / MARKER} is for step {marker.get('step')!r}, "
                                     f"the manifest for step {manifest.step}")
    facts = marker_facts(marker, step_dir / MARKER)
    if (facts.world_size not in (None, manifest.world_size)
            or facts.total_bytes not in (None, manifest.total_bytes)):
        raise CorruptCheckpointError(f"commit marker {step_dir / MARKER} disagrees with the manifest on the world "
                                     "size or the total bytes")
    return manifest


def read_pinned(step_dir: Path, step: int, digest: str, sent: bytes | None = None) -> Manifest:
    """The manifest of `step_dir` that rank 0 chose to restore, on another rank: the bytes rank 0
    `sent` (by broadcast: no open of the file, one per rank against one metadata server), or,
    when it sent none, the file's. They must hash to `digest` (what rank 0 read, pinned by the
    commit marker it checked), so the marker is not read again; CorruptCheckpointError when they
    do not (the file changed since, or the bytes were damaged on the way). Those are the bytes
    rank 0 validated (`read_manifest`) before it chose them: their per-shard and per-tensor
    sections are not checked again here (O(W + T) on every rank), the rest as `validate_manifest`.
    They are parsed with plain `json.loads`: rank 0's strict parse (`jsonenc.loads`: no duplicate
    keys, no NaN literals) of these very bytes already passed, so the strict parse's per-object
    hook is not paid again on every rank (16,384 ranks, 405B: 1.55 MB, ~1.7 ms of each plan)."""
    raw = sent if sent is not None else read_bounded(step_dir / MANIFEST, manifest_cap(), "manifest")
    if xxhash.xxh3_64_hexdigest(raw) != digest:
        if sent is not None:
            raise CorruptCheckpointError(f"manifest {step_dir / MANIFEST}: the bytes rank 0 sent for step {step} "
                                         "do not match the checksum it pinned (damaged on the way?)")
        raise CorruptCheckpointError(f"manifest {step_dir / MANIFEST} changed since rank 0 chose step {step} "
                                     "(its checksum no longer matches what the commit marker pinned)")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not after rank 0's parse of the same bytes; never a traceback
        raise UnsafeCheckpointError(f"manifest {step_dir / MANIFEST} is not valid JSON: {exc}") from exc
    manifest = validate_manifest(data, step_dir, step, checked=True)
    manifest.digest = digest
    return manifest


def validate_manifest(data: Any, step_dir: Path, expected_step: int | None, checked: bool = False) -> Manifest:
    """The Manifest of parsed manifest.json `data`, validated (UnsafeCheckpointError naming the
    file). `checked`: bytes whose digest matches those another reader validated (`read_pinned`):
    the shard table and the format-2+ tensor section are taken as they are."""
    where = step_dir / MANIFEST

    def bad(msg: str) -> CorruptCheckpointError:
        return UnsafeCheckpointError(f"manifest {where}: {msg}")

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    if data.get("format") not in FORMATS_READ:
        raise bad(f"format {data.get('format')!r} is not one of {', '.join(FORMATS_READ)}")
    v2 = data["format"] != FORMATS_READ[0]
    columnar = data["format"] == FORMATS_READ[2]
    step, world = data.get("step"), data.get("world_size")
    if not is_int(step) or step < 0 or (expected_step is not None and step != expected_step):
        raise bad(f"step {step!r} does not match the directory")
    if not is_int(world) or world < 1:
        raise bad(f"world_size {world!r} is not a positive integer")
    shards = data.get("shards")
    if columnar:
        if not checked and (why := table_problem(shards, world)):
            raise bad(why)
        shards = ShardTable(shards if isinstance(shards, dict) else {}, world)
    elif not isinstance(shards, list) or len(shards) != world:
        raise bad(f"expected {world} shards")
    elif not checked and (why := shard_problem(shards, v2)):
        raise bad(why)
    created = data.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not 0 <= created < MAX_TIME:
        raise bad(f"created time {created!r} is missing or not a plausible epoch time")
    try:
        if v2:
            if not checked:
                check_once(data)
            return Manifest(step, world, float(created), shards, data.get("metrics"), data.get("meta"), data,
                            step_dir)
        tensors, sharded = check_v1(data, world)
        return Manifest(step, world, float(created), shards, data.get("metrics"), data.get("meta"), data, step_dir,
                        tensors, sharded)
    except CorruptCheckpointError as exc:
        raise bad(str(exc).removeprefix(f"manifest {where}: ")) from None



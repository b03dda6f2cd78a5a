"""manifest.json and the commit marker: building them (coordinator) and validating them (anyone)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import xxhash

from ..errors import CorruptCheckpointError, UnreadableCheckpointError, UnsafeCheckpointError
from . import jsonenc
from .bounded import read_bounded as read_bounded  # re-exported: the mirror reads through it
from .jsonenc import dumps, loads
from .layout import FORMAT, FORMATS_READ, MANIFEST, MARKER, is_plain_shard_name
from .rankindex import check_shard_entry
from .shard import VERIFY_BLOCK, Expected

MAX_MANIFEST = 64 << 20
MAX_MARKER = 4096
MAX_TIME = 1e11  # epoch seconds (year 5138): what time.strftime and datetime can render
_FORMAT_PREFIX = "slurmresume/"


def format_version(fmt: Any) -> int | None:
    """N of a format string "slurmresume/N", else None (not a format of ours)."""
    if not isinstance(fmt, str) or not fmt.startswith(_FORMAT_PREFIX):
        return None
    n = fmt.removeprefix(_FORMAT_PREFIX)
    return int(n) if n.isascii() and n.isdigit() and len(n) < 10 else None


READS = format_version(FORMAT)  # the manifest format this version reads and writes


def newer_format(fmt: Any) -> str | None:
    """Why this version cannot read format `fmt` when a newer slurmresume wrote it, else None."""
    n = format_version(fmt)
    if n is None or READS is None or n <= READS:
        return None
    return f"written by a newer slurmresume (format {n}; this reads {READS}): upgrade slurmresume to use it"


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


def build_manifest(step: int, reports: list[dict[str, Any]], metrics: Any, meta: Any) -> dict[str, Any]:
    """Rank 0: the format-2 manifest from every rank's fixed-size record (ordered by rank): per
    shard its file, size and checksums and its index file's; each DTensor's dtype, global shape
    and placements once (from rank 0's record); the names stored once, in shard 0."""
    shards = []
    for rep in sorted(reports, key=lambda r: r["rank"]):
        shards.append({k: rep[k] for k in _SHARD_KEYS})
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
        "metrics": metrics,
        "meta": meta,
    }


_SHARD_KEYS = ("file", "rank", "bytes", "xxh3", "header_xxh3", "index", "index_bytes", "index_xxh3")


def marker_bytes(step: int, manifest_raw: bytes, manifest: dict[str, Any] | None = None) -> bytes:
    """The commit marker. Its "format" lets a reader tell a newer release's step from a corrupt
    one before it reads the manifest. Given the manifest, it also records what a scan asks
    (world size, total bytes, metrics) so that a scan can answer from the marker alone; the
    metrics only while the marker stays within MAX_MARKER ("metrics_omitted" otherwise). Since
    the manifest's checksum covers none of these, the marker carries its own ("marker_xxh3", see
    `check_marker`). Older readers look at "step" and "manifest_xxh3" only."""
    marker: dict[str, Any] = {"step": step, "format": FORMAT, "manifest_xxh3": xxhash.xxh3_64_hexdigest(manifest_raw)}
    if manifest is not None:
        marker["world_size"] = manifest["world_size"]
        marker["total_bytes"] = sum(s["bytes"] for s in manifest["shards"])
        raw = _sealed({**marker, "metrics": manifest.get("metrics")})
        if len(raw) <= MAX_MARKER:
            return raw
        marker["metrics_omitted"] = True
    return _sealed(marker)


_OLD_MARKER = {"step", "manifest_xxh3"}  # what releases before the marker's own checksum wrote


def _sealed(marker: dict[str, Any]) -> bytes:
    return dumps({**marker, "marker_xxh3": xxhash.xxh3_64_hexdigest(dumps(marker).encode())}).encode()


def check_marker(marker: dict[str, Any], where: Path | str) -> None:
    """CorruptCheckpointError unless the parsed marker is an older release's (exactly step and
    manifest_xxh3) or matches its own checksum: one flipped bit anywhere in it is detected."""
    if set(marker) == _OLD_MARKER:
        return
    rest = {k: v for k, v in marker.items() if k != "marker_xxh3"}
    if marker.get("marker_xxh3") != xxhash.xxh3_64_hexdigest(dumps(rest).encode()):
        raise CorruptCheckpointError(f"commit marker {where}/{MARKER} fails its own checksum (damaged)")


@dataclass(frozen=True)
class MarkerFacts:
    """What a commit marker says about its step without the manifest (None: an older marker)."""

    step: int
    world_size: int | None
    total_bytes: int | None
    metrics: Any
    metrics_known: bool  # False: an older marker, or metrics too big for it (read the manifest)


def marker_facts(data: Any, where: Path) -> MarkerFacts:
    """Validate a parsed marker's scan fields; CorruptCheckpointError when one is malformed."""
    if not isinstance(data, dict) or not _is_int(data.get("step")) or data["step"] < 0:
        raise CorruptCheckpointError(f"commit marker {where} has no valid step")
    world, total = data.get("world_size"), data.get("total_bytes")
    if world is not None and not (_is_int(world) and world >= 1):
        raise CorruptCheckpointError(f"commit marker {where}: world_size {world!r} is not a positive integer")
    if total is not None and not (_is_int(total) and total >= 0):
        raise CorruptCheckpointError(f"commit marker {where}: total_bytes {total!r} is not a byte count")
    return MarkerFacts(data["step"], world, total, data.get("metrics"), "metrics" in data)


@dataclass
class Manifest:
    """A validated manifest, plus what the loader needs to trust it. Format 1 lists every rank's
    tensors itself (`listed`); format 2 keeps them in per-rank index files, read (and checked
    against the manifest) only when asked: `rank_tensors(r)` opens rank r's alone."""

    step: int
    world_size: int
    created: float
    shards: list[dict[str, Any]]
    metrics: Any
    meta: Any
    raw: dict[str, Any] = field(repr=False)
    directory: Path = field(default=Path("."), repr=False)
    listed: list[dict[str, Any]] | None = field(default=None, repr=False)  # format 1's tensor list
    _sharded: dict[str, Any] | None = field(default=None, repr=False)  # name -> sharding.Sharded (DTensors)
    _indexes: dict[int, dict[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def total_bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    @property
    def version(self) -> int:
        return format_version(self.raw.get("format")) or 0

    @property
    def has_block_digests(self) -> bool:
        """Written with per-block tensor digests (every read verifiable as it happens); older
        checkpoints need the whole-shard checksum pass instead."""
        return self.raw.get("verify_block") == VERIFY_BLOCK and all("header_xxh3" in s for s in self.shards)

    def rank_tensors(self, rank: int) -> dict[str, dict[str, Any]]:
        """Shard `rank`'s tensor entries {name: info}; format 2 reads and checks its index file
        (once per Manifest), and no other."""
        if self.listed is not None:
            return {t["name"]: t for t in self.listed if t.get("rank") == rank}
        if rank not in self._indexes:
            from .rankindex import check_pieces, read_index

            entries = read_index(self.directory, self.shards[rank])
            check_pieces(entries, rank, self.world_size, self.raw.get("sharded") or {})
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
                out.append({"name": name, "rank": rank, **info, **({"replicated": True} if rank == 0
                                                                      and name in shared else {})})
        return out

    @property
    def sharded(self) -> dict[str, Any]:
        """name -> sharding.Sharded: every saved piece of each DTensor (format 2: from every index)."""
        if self._sharded is None:
            from .placement import arithmetic
            from .sharding import Sharded, index_pieces

            specs = self.raw.get("sharded") or {}
            if self.listed is None and all(arithmetic(sp, self.world_size) for sp in specs.values()):
                # format 2 from one full mesh: pieces by rank arithmetic, no index file read
                self._sharded = {n: Sharded(n, sp["dtype"], tuple(sp["shape"]), (),
                                            (tuple(sp["mesh_shape"]), tuple(sp["placements"])))
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
        """The digests a verified read of shard `rank` checks, or None for an older checkpoint."""
        if not self.has_block_digests:
            return None
        blocks = {n: t["xxh3"] for n, t in self.rank_tensors(rank).items() if "xxh3" in t}
        return Expected(self.shards[rank]["header_xxh3"], blocks)


def read_manifest(step_dir: Path, expected_step: int | None = None) -> Manifest:
    """Read and validate manifest + marker of a step directory. Raises CorruptCheckpointError
    (or UnsafeCheckpointError) naming the file; UnreadableCheckpointError for a step written by
    a newer slurmresume or over this version's read caps (not corrupt); never reads outside
    `step_dir`."""
    if step_dir.is_symlink():  # its files would be read from wherever the link points
        raise UnsafeCheckpointError(f"refusing checkpoint {step_dir}: not a real directory (a symbolic link)")
    marker_raw = read_bounded(step_dir / MARKER, MAX_MARKER, "commit marker")
    marker = loads(marker_raw, f"commit marker {step_dir / MARKER}")
    raw = None
    if os.path.lexists(step_dir / MANIFEST) or not _says_newer(marker):  # a newer layout may have none
        raw = read_bounded(step_dir / MANIFEST, manifest_cap(), "manifest")
    data = pinned_manifest(marker, raw, step_dir)
    manifest = validate_manifest(data, step_dir, expected_step)
    if marker.get("step") != manifest.step:
        raise CorruptCheckpointError(f"commit marker {step_dir / MARKER} is for step {marker.get('step')!r}, "
                                     f"the manifest for step {manifest.step}")
    facts = marker_facts(marker, step_dir / MARKER)
    if (facts.world_size not in (None, manifest.world_size)
            or facts.total_bytes not in (None, manifest.total_bytes)):
        raise CorruptCheckpointError(f"commit marker {step_dir / MARKER} disagrees with the manifest on the world "
                                     "size or the total bytes")
    return manifest


def _says_newer(data: Any) -> bool:
    return isinstance(data, dict) and newer_format(data.get("format")) is not None


def pinned_manifest(marker: Any, raw: bytes | None, where: Path | str) -> Any:
    """The parsed manifest `raw` (None: absent) that the parsed `marker` pins, or why not.
    The format is trusted only where a checksum backs it, so that a flipped bit is "corrupt",
    never "newer": a manifest its marker pins may say a newer format (UnreadableCheckpointError);
    a marker that does not pin its manifest is unreadable only when it says a newer format
    itself (a newer release may pin differently), else corrupt."""
    if raw is None or not (isinstance(marker, dict) and marker.get("manifest_xxh3") == xxhash.xxh3_64_hexdigest(raw)):
        refuse_newer(marker, where)
        what = "is missing" if raw is None else "does not match its commit marker (edited?)"
        raise CorruptCheckpointError(f"manifest {where}/{MANIFEST} {what}")
    data = loads(raw, f"manifest {where}/{MANIFEST}")
    refuse_newer(data, where)
    if _says_newer(marker):
        raise CorruptCheckpointError(f"commit marker {where}/{MARKER} says format {marker.get('format')!r}, the "
                                     "manifest it pins is this version's (a damaged marker?)")
    check_marker(marker, where)
    return data


def refuse_newer(data: Any, step_dir: Path | str) -> None:
    """UnreadableCheckpointError when the parsed marker or manifest `data` says a newer format."""
    why = newer_format(data.get("format")) if isinstance(data, dict) else None
    if why is not None:
        raise UnreadableCheckpointError(f"checkpoint {step_dir} is unreadable by this version: {why}")


def validate_manifest(data: Any, step_dir: Path, expected_step: int | None) -> Manifest:
    where = step_dir / MANIFEST

    def bad(msg: str) -> CorruptCheckpointError:
        return UnsafeCheckpointError(f"manifest {where}: {msg}")

    if not isinstance(data, dict):
        raise bad("not a JSON object")
    if data.get("format") not in FORMATS_READ:
        raise bad(f"format {data.get('format')!r} is not one of {', '.join(FORMATS_READ)}")
    v2 = data["format"] != FORMATS_READ[0]
    step, world = data.get("step"), data.get("world_size")
    if not _is_int(step) or step < 0 or (expected_step is not None and step != expected_step):
        raise bad(f"step {step!r} does not match the directory")
    if not _is_int(world) or world < 1:
        raise bad(f"world_size {world!r} is not a positive integer")
    shards = data.get("shards")
    if not isinstance(shards, list) or len(shards) != world:
        raise bad(f"expected {world} shards")
    for i, s in enumerate(shards):
        if not isinstance(s, dict) or s.get("rank") != i:
            raise bad(f"shard entry {i} is malformed")
        if not is_plain_shard_name(s.get("file")):
            raise bad(f"shard name {s.get('file')!r} is not a plain shard file name (no '/', no '..')")
        if not _is_int(s.get("bytes")) or s["bytes"] < 8:
            raise bad(f"shard {s.get('file')} has an invalid size {s.get('bytes')!r}")
        if not (isinstance(s.get("xxh3"), str) and len(s["xxh3"]) == 16):
            raise bad(f"shard {s.get('file')} has no valid checksum")
        if "header_xxh3" in s and not (isinstance(s["header_xxh3"], str) and len(s["header_xxh3"]) == 16):
            raise bad(f"shard {s.get('file')} has a malformed header checksum")
        if v2 and (why := check_shard_entry(s, i)):
            raise bad(why)
    if len({s["file"] for s in shards}) != len(shards):
        raise bad("two shard entries name the same file")
    created = data.get("created")
    if not isinstance(created, (int, float)) or isinstance(created, bool) or not 0 <= created < MAX_TIME:
        raise bad(f"created time {created!r} is missing or not a plausible epoch time")
    try:
        if v2:
            check_once(data)
            return Manifest(step, world, float(created), shards, data.get("metrics"), data.get("meta"), data,
                            step_dir)
        return _v1(data, step, world, float(created), shards, step_dir)
    except CorruptCheckpointError as exc:
        raise bad(str(exc).removeprefix(f"manifest {where}: ")) from None


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


def _v1(data: dict[str, Any], step: int, world: int, created: float, shards: list[dict[str, Any]],
        step_dir: Path) -> Manifest:
    """Format 1: the manifest lists every rank's tensors; checked (DTensor pieces too) here."""
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

    sharded = index_pieces(tensors, world)
    return Manifest(step, world, created, shards, data.get("metrics"), data.get("meta"), data, step_dir,
                    tensors, sharded)


def _is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)

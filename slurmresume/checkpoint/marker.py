"""The commit marker and the format string: what a reader checks before (and beside) the manifest.

The marker (<= MAX_MARKER bytes, sealed by its own checksum) pins the manifest by its xxh3 and
says the format, so that a newer release's step is "unreadable by this version", never "corrupt";
it also carries what a scan asks (world size, total bytes, metrics), see `marker_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import xxhash

from ..errors import CorruptCheckpointError, UnreadableCheckpointError
from .jsonenc import dumps, loads
from .layout import FORMAT, MANIFEST, MARKER

MAX_MARKER = 4096
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
        from .shardtable import total

        marker["total_bytes"] = total(manifest["shards"])
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
    if not isinstance(data, dict) or not is_int(data.get("step")) or data["step"] < 0:
        raise CorruptCheckpointError(f"commit marker {where} has no valid step")
    world, total = data.get("world_size"), data.get("total_bytes")
    if world is not None and not (is_int(world) and world >= 1):
        raise CorruptCheckpointError(f"commit marker {where}: world_size {world!r} is not a positive integer")
    if total is not None and not (is_int(total) and total >= 0):
        raise CorruptCheckpointError(f"commit marker {where}: total_bytes {total!r} is not a byte count")
    return MarkerFacts(data["step"], world, total, data.get("metrics"), "metrics" in data)


def says_newer(data: Any) -> bool:
    return isinstance(data, dict) and newer_format(data.get("format")) is not None


def refuse_newer(data: Any, step_dir: Path | str) -> None:
    """UnreadableCheckpointError when the parsed marker or manifest `data` says a newer format
    (a marker: through `refuse_newer_marker`, which believes only an intact one)."""
    why = newer_format(data.get("format")) if isinstance(data, dict) else None
    if why is not None:
        raise UnreadableCheckpointError(f"checkpoint {step_dir} is unreadable by this version: {why}")


def refuse_newer_marker(marker: Any, step_dir: Path | str) -> None:
    """`refuse_newer` for a parsed commit marker, which is believed only where its own checksum
    backs it: a marker that carries "marker_xxh3" and fails it is damaged (CorruptCheckpointError),
    whatever its format says, so that a flipped bit is never "newer". "marker_xxh3" is frozen: a
    release that seals its marker otherwise names its checksum otherwise, and a marker without
    "marker_xxh3" that says a newer format is such a release's (UnreadableCheckpointError)."""
    if isinstance(marker, dict) and "marker_xxh3" in marker:
        check_marker(marker, step_dir)
    refuse_newer(marker, step_dir)


def is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def pinned_manifest(marker: Any, raw: bytes | None, where: Path | str) -> Any:
    """The parsed manifest `raw` (None: absent) that the parsed `marker` pins, or why not.
    The format is trusted only where a checksum backs it, so that a flipped bit is "corrupt",
    never "newer": a manifest its marker pins may say a newer format (UnreadableCheckpointError);
    a marker that does not pin its manifest is unreadable only when it says a newer format
    itself and does not fail its own checksum (a newer release may pin differently), else corrupt."""
    if raw is None or not (isinstance(marker, dict) and marker.get("manifest_xxh3") == xxhash.xxh3_64_hexdigest(raw)):
        refuse_newer_marker(marker, where)
        what = "is missing" if raw is None else "does not match its commit marker (edited?)"
        raise CorruptCheckpointError(f"manifest {where}/{MANIFEST} {what}")
    data = loads(raw, f"manifest {where}/{MANIFEST}")
    refuse_newer(data, where)
    if says_newer(marker):
        raise CorruptCheckpointError(f"commit marker {where}/{MARKER} says format {marker.get('format')!r}, the "
                                     "manifest it pins is this version's (a damaged marker?)")
    check_marker(marker, where)
    return data

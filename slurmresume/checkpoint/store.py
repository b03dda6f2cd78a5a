"""Reading a checkpoint root: list step directories, find the newest complete one, verify.

A directory is *complete* only when its commit marker exists, matches the manifest, and every
shard has the size the manifest records. Checksums are checked on request (`verify`).

Scans (`scan=True`: `latest`, `status`, retention) judge a step by its commit marker alone
(<= 4 KiB, sealed by its own checksum; it carries the world size, total bytes and metrics):
no manifest is parsed and no shard opened, whatever the world size. Only a marker written
before those fields existed (or whose metrics did not fit) sends a scan to the manifest.
`verify` still reads the manifest and checks every file's size; a restore reads the manifest
and each rank checks the size of every file it opens.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..errors import (
    CorruptCheckpointError,
    NotPermittedError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
)
from .bounded import UNREADABLE as UNREADABLE
from .layout import INPROGRESS, MANIFEST, MARKER, step_dirs
from .manifest import (
    MAX_MARKER,
    Manifest,
    MarkerFacts,
    check_marker,
    manifest_cap,
    marker_facts,
    read_bounded,
    read_manifest,
    refuse_newer_marker,
)
from .shardread import check_name, check_span, hash_file, open_checked, split_locator

log = logging.getLogger("slurmresume")


@dataclass
class CheckpointInfo:
    """One step of a root, as inspected: the same record on every tier (storage.py). On a
    bucket, `path` is the step folder's name and `location` its URL (see `url`)."""

    step: int
    path: Path
    has_marker: bool
    manifest: Manifest | None = None
    problem: str | None = None
    verified: bool | None = None  # None: checksums not computed
    mtime: float = 0.0
    in_progress: bool = False
    unreadable: bool = False  # not by this version's rules (newer format, over a cap) or this user's: not corrupt
    facts: MarkerFacts | None = None  # a scan's answer from the marker alone (manifest left unread)
    uploading: bool = False  # a bucket: an unfinished multipart upload exists under it
    location: str | None = None  # a bucket: the step's s3:// URL (None: `path` is the step directory)

    @property
    def url(self) -> str:
        """Where the step is, as the commands print it: its directory, or its URL on a bucket."""
        return self.location if self.location is not None else os.fspath(self.path)

    @property
    def complete(self) -> bool:
        return self.has_marker and (self.manifest is not None or self.facts is not None) and self.problem is None

    @property
    def metrics(self) -> Any:
        return self.manifest.metrics if self.manifest else self.facts.metrics if self.facts else None

    @property
    def world_size(self) -> int | None:
        return self.manifest.world_size if self.manifest else self.facts.world_size if self.facts else None

    @property
    def total_bytes(self) -> int:
        if self.manifest:
            return self.manifest.total_bytes
        if self.facts and self.facts.total_bytes is not None:
            return self.facts.total_bytes
        return _dir_bytes(self.path) if self.location is None else 0

    @property
    def created(self) -> float:
        return self.manifest.created if self.manifest else self.mtime


def _dir_bytes(path: Path) -> int:
    total = 0
    try:
        with os.scandir(path) as it:
            for e in it:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
    except OSError:
        pass
    return total


def check_sizes(info_path: Path, manifest: Manifest) -> None:
    for s in manifest.files:
        os.close(open_checked(info_path, s["file"], s["bytes"]))


def stat_sizes(path: Path, manifest: Manifest) -> None:
    """`check_sizes` by lstat, opening no file (retention's check of the steps it keeps): every
    file the manifest lists is a plain regular file holding its recorded bytes. Raises
    CorruptCheckpointError (missing, truncated or replaced) or UnsafeCheckpointError (not a plain
    regular file, a name that is not ours), naming the file."""
    seen: dict[str, os.stat_result] = {}
    for s in manifest.files:
        check_name(path, s["file"])
        name = split_locator(s["file"])[0]
        if name not in seen:  # a node file holds the ranges of several ranks: one lstat
            try:
                seen[name] = os.lstat(path / name)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"shard {path / name} is missing") from None
        if not stat.S_ISREG(seen[name].st_mode):
            raise UnsafeCheckpointError(f"refusing shard {path / name}: not a regular file")
        check_span(path, s["file"], s["bytes"], seen[name].st_size)


def check_checksums(path: Path, manifest: Manifest) -> list[str]:
    """Problems found (empty list: every shard matches its checksum, and its header and JSON
    skeleton are what a restore accepts, so that a verified checkpoint also loads)."""
    problems = []
    shards = {s["file"] for s in manifest.shards}
    for s in manifest.files:  # the shards, then (format 2) their index files
        try:
            digest = hash_file(path, s["file"], s["bytes"])
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
            continue
        if digest != s["xxh3"]:
            what = "shard" if s["file"] in shards else "tensor index"
            problems.append(f"{what} {path / s['file']} fails its checksum (xxh3 {digest}, manifest {s['xxh3']})")
    return problems or check_structure(path, manifest)


def check_structure(path: Path, manifest: Manifest) -> list[str]:
    """What a loader would refuse in the shards' headers and skeletons (bounds, dtypes, offsets,
    tags, tensor references), found without reading tensor bytes. Empty list: none."""
    from .jsonenc import decode, loads
    from .shard import SKELETON_KEY
    from .shardread import read_header
    from .state import validate_skeleton

    problems: list[str] = []
    first: set[str] | None = None
    for s in manifest.shards:
        where = path / s["file"]
        try:
            header, _ = read_header(path, s["file"], s["bytes"])
            names = {n for n in header if n != "__metadata__"}
            if first is None:
                first = names
            meta = header.get("__metadata__") or {}
            if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
                raise CorruptCheckpointError(f"metadata of {where} is malformed")
            skeleton = loads(meta.get(SKELETON_KEY, ""), f"skeleton of {where}")
            shared = skeleton.get("replicated", []) if isinstance(skeleton, dict) else []
            if not isinstance(shared, list) or not all(isinstance(n, str) for n in shared):
                raise CorruptCheckpointError(f"skeleton of {where}: malformed list of replicated tensors")
            validate_skeleton([], skeleton, names | (set(shared) & first), strict=False)
            for entry in skeleton["entries"].values():
                decode(entry["value"], lambda name: None)
            decode(skeleton.get("library", {}), lambda name: None)
            _agrees_with_index(manifest, s, header, where)
        except CorruptCheckpointError as exc:
            problems.append(str(exc))
        except RecursionError:
            problems.append(f"skeleton of {where} is nested too deeply")
    return problems


def _agrees_with_index(manifest: Manifest, shard: dict[str, Any], header: Any, where: Path) -> None:
    """Format 2+: the rank's index is what a restore may read (its pieces against the placements:
    `Manifest.rank_tensors`), and the block digests its header carries (shard.BLOCKS_KEY), which
    a restore checks instead of the index's, are the index's. CorruptCheckpointError otherwise."""
    if manifest.listed is not None or "rank" not in shard:
        return
    entries = manifest.rank_tensors(shard["rank"])
    for name, digests in header.blocks(where).items():
        info = entries.get(name)
        if info is None or "".join(info.get("xxh3") or ()) != digests:
            raise CorruptCheckpointError(f"shard {where}: the block digests in its header for tensor {name!r} "
                                         "disagree with its tensor index")


def inspect_dir(step: int, path: Path, verify: bool = False, scan: bool = False, *,
                sizes: bool = True) -> CheckpointInfo:
    """Everything knowable about one step directory; never raises for a bad checkpoint. With
    `scan` (and no `verify`), a step whose marker carries the scan fields is judged by the marker
    alone (`info.facts`, `info.manifest` None): see the module docstring. `sizes=False` (a
    restore's choice: each rank checks the sizes of the files it opens) skips the open of every
    file to check its size."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return CheckpointInfo(step, path, False, problem="directory vanished")
    if not stat.S_ISDIR(st.st_mode):  # from the lstat: a link or a file (not a dir renamed away since)
        info = CheckpointInfo(step, path, (path / MARKER).exists(), mtime=st.st_mtime)
        info.problem = "not a real directory"
        return info
    if not os.access(path, os.R_OK | os.X_OK):  # one unreadable directory must not break every command
        return CheckpointInfo(step, path, False, mtime=st.st_mtime, problem=UNREADABLE, unreadable=True)
    info = CheckpointInfo(step, path, (path / MARKER).exists(), mtime=st.st_mtime)
    info.in_progress = (path / INPROGRESS).exists()  # retention asks it of a complete `.saving.*` too
    if not info.has_marker:
        info.problem = "no commit marker (incomplete or being written)"
        return info
    try:
        if scan and not verify and (facts := scan_marker(path, step)) is not None:
            info.facts = facts
            return info
        info.manifest = read_manifest(path, expected_step=step, real_dir=True)  # lstat'ed above
        if sizes or verify:
            check_sizes(path, info.manifest)
        if verify:
            problems = check_checksums(path, info.manifest)
            info.verified = not problems
            if problems:
                info.problem = "; ".join(problems)
                return _unless_vanished(info)
    except (NotPermittedError, PermissionError) as exc:  # another user's file: never "corrupt"
        where = exc.path if isinstance(exc, NotPermittedError) else exc.filename
        info.manifest, info.facts, info.problem, info.unreadable = None, None, f"{UNREADABLE} ({where})", True
        return _unless_vanished(info)
    except UnreadableCheckpointError as exc:
        info.problem, info.unreadable = str(exc), True
        return _unless_vanished(info)
    except CorruptCheckpointError as exc:
        info.problem = str(exc)
        return _unless_vanished(info)
    return info


def scan_marker(path: Path, step: int) -> MarkerFacts | None:
    """What the commit marker of step directory `path` says, when it answers a scan (world size,
    total bytes, metrics); None for an older marker without them (read the manifest). Raises
    CorruptCheckpointError (own checksum fails, malformed, another step's) or
    UnreadableCheckpointError (a newer format, in an intact marker)."""
    from .jsonenc import loads

    where = path / MARKER
    data = loads(read_bounded(where, MAX_MARKER, "commit marker"), f"commit marker {where}")
    facts = marker_facts(data, where)
    refuse_newer_marker(data, path)  # a damaged marker is corrupt, never "newer"
    check_marker(data, path)
    if facts.step != step:
        raise CorruptCheckpointError(f"commit marker {where} is for step {facts.step}, not {step}")
    if facts.world_size is None or facts.total_bytes is None or not facts.metrics_known:
        return None
    # A commit promises the step loads, but a marker does not say so for a manifest over this
    # version's cap (an older release's commit, a lowered cap): one stat, and any doubt (missing,
    # not a plain file, too big) goes to the full read, which classifies it precisely.
    try:
        st = (path / MANIFEST).lstat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > manifest_cap():
        return None
    return facts


def _unless_vanished(info: CheckpointInfo) -> CheckpointInfo:
    """A prune renames a directory away in one step: files missing because the whole directory
    went while it was being read mean "deleted", not "corrupt" (no false alarm in `status`)."""
    if os.path.lexists(info.path):
        return info
    return CheckpointInfo(info.step, info.path, False, problem="directory vanished (deleted while being read)",
                          mtime=info.mtime)


def list_checkpoints(root: Path, verify: bool = False, scan: bool = False) -> list[CheckpointInfo]:
    """Every step directory under root, newest first, each inspected (`scan`: see inspect_dir)."""
    return [inspect_dir(step, path, verify, scan) for step, path in step_dirs(Path(root))]


def find_latest(root: Path, verify: bool = False, exclude: set[int] | None = None,
                max_step: int | None = None, warn: bool = True, scan: bool = False, *,
                sizes: bool = True, skipped: Callable[[CheckpointInfo], None] | None = None) -> CheckpointInfo | None:
    """The newest complete checkpoint (checked newest-first, stopping at the first good one).
    Incomplete or corrupt newer directories are skipped, with a warning naming each (`warn`),
    and handed to `skipped`. A newer step this version cannot read (`CheckpointInfo.unreadable`)
    is not skipped: it raises UnreadableCheckpointError, since resuming an older step would
    later overwrite it."""
    for step, path in step_dirs(Path(root)):
        if (exclude and step in exclude) or (max_step is not None and step > max_step):
            continue
        info = inspect_dir(step, path, verify, scan, sizes=sizes)
        if info.complete:
            return info
        if info.unreadable:
            raise unreadable_error(info)
        if warn:
            log.warning("skipping %s: %s", path, info.problem)
        if skipped is not None:
            skipped(info)
    return None


def unreadable_error(info: CheckpointInfo) -> UnreadableCheckpointError:
    """The one-line refusal of step `info` that this version or this user cannot read (a newer
    format, over a cap, permission denied): naming it and why, never resuming an older step."""
    why = info.problem or "unreadable by this version"
    if why.startswith(UNREADABLE):
        return NotPermittedError(f"checkpoint {info.path} is {why}: not resuming an older step past it", info.path)
    return UnreadableCheckpointError(why)


def newest_committed(root: Path) -> int | None:
    """The highest step whose directory holds a commit marker; reads no manifest. For decisions
    that need only "is there something to resume" (the launcher): a committed step this version
    cannot parse still counts, and the ranks that load it report what is wrong with it."""
    for step, path in step_dirs(Path(root)):
        if os.path.lexists(path / MARKER):
            return step
    return None


def marker_digests(root: Path) -> dict[int, str]:
    """Every committed step of `root` with the xxh3 of its commit marker, newest first: the identity
    of one save of a step (its marker pins its manifest), compared across the memory tier's node
    roots and replicas (train/memrestore.py, job/promote.py). Never raises: what cannot be read
    is left out."""
    held: dict[int, str] = {}
    try:
        dirs = step_dirs(Path(root))
    except OSError:
        return held
    for step, path in dirs:
        try:
            held[step] = xxhash.xxh3_64_hexdigest((path / MARKER).read_bytes())
        except OSError:
            continue
    return held


def remove_private_step(path: Path) -> None:
    """A step directory of a root no other process reads (a memory root, a peer's replica), gone:
    its marker first (never seen committed and partial), then the rest. Never raises. A shared
    checkpoint root's steps go through retention (a rename under the root lock) instead."""
    try:
        os.unlink(path / MARKER)
    except OSError:
        pass
    shutil.rmtree(path, ignore_errors=True)


def clean_temp_files(step_dir: Path, committed: bool = False) -> list[str]:
    """Remove what a killed writer left inside a *committed* step directory: temp files
    (`.<name>.tmp.<pid>`) and a stale `.inprogress` note. A committed directory is never written
    again, and no reader opens these names, so removing them cannot break a reader. Best effort;
    returns the names removed. Called by restore (rank 0) on the directory it is about to load
    (`committed`: its marker was just read, not looked up again)."""
    removed: list[str] = []
    if not committed and not (step_dir / MARKER).exists():
        return removed
    try:
        names = [e.name for e in os.scandir(step_dir)
                 if e.is_file(follow_symlinks=False) and (".tmp." in e.name and e.name.startswith(".")
                                                          or e.name == INPROGRESS)]
    except OSError:
        return removed
    for name in names:
        try:
            os.unlink(step_dir / name)
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed leftovers of a killed writer from %s: %s", step_dir, ", ".join(sorted(removed)))
    return removed


def age_seconds(info: CheckpointInfo, now: float | None = None) -> float:
    return max(0.0, (now if now is not None else time.time()) - info.created)

"""Moving one committed step between a local root and the bucket, with the commit intact.

Upload (one process, rank 0): read and check the local marker + manifest, open every shard
(held open: a local prune during the upload cannot pull bytes out from under it), upload the
files and the manifest under this attempt's own folder (upload.py: parts in flight on one
pool, memory bounded by `settings.upload_mib`), while one listing notes what killed writers
left under the step; then the marker with `If-None-Match: *` naming that folder, then read
the marker's writer token back (storage/bucketcommit.py). The marker is the last object written, so no
reader sees the step complete before its files; whoever loses the marker race removes its own
folder, the winner what the listing found.

Download: marker + manifest checked first, shards fetched with parallel ranged GETs into a
hidden `.mirror-download.*` directory and hashed as they arrive (download.py), every shard's
xxh3 compared with the manifest, manifest and marker written durably last, then one rename
makes the step visible locally.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..checkpoint import fsio, leftovers
from ..checkpoint.commit import move_aside, root_lock
from ..checkpoint.jsonenc import loads
from ..checkpoint.layout import INPROGRESS, MANIFEST, MARKER, step_dir_name
from ..checkpoint.manifest import (
    MAX_MANIFEST,
    MAX_MARKER,
    Manifest,
    read_bounded,
    read_manifest,
)
from ..checkpoint.nodefile import refuse_mirror
from ..checkpoint.shardread import open_checked
from ..checkpoint.store import inspect_dir
from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.bucketcommit import (
    Garbage,
    RemoteCommit,
    garbage,
    new_attempt,
    put_marker,
    read_remote_commit,
    remove,
    sweep,
)

__all__ = ["RemoteCommit", "Transfer", "download_step", "put_marker", "read_remote_commit", "upload_step"]
from ..storage.s3 import S3Location, get_bounded, point
from ..storage.settings import MirrorSettings
from .download import fetch_shard, part_size
from .own import OwnAttempts
from .upload import MIB, Item, UploadPlan, plan_upload, upload_files

log = logging.getLogger("slurmresume")

# Uploads: part size and parts in flight from the largest file's size and a memory bound
# (upload.plan_upload). Downloads stream each range through a 1 MiB buffer, so their memory
# does not grow with the range size; the part size follows the object's size (download.part_size).
DOWNLOAD_WORKERS = 8
DOWNLOAD_PREFIX = leftovers.DOWNLOAD_PREFIX  # one name, which checkpoint/leftovers.py cleans up


@dataclass(frozen=True)
class Transfer:
    step: int
    action: str  # "uploaded" | "present" (same marker already there) | "conflict" | "downloaded"
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""


def read_committed(step_dir: Path, step: int) -> tuple[bytes, bytes, Manifest]:
    """(marker bytes, manifest bytes, validated manifest) of a local committed step."""
    marker_raw = read_bounded(step_dir / MARKER, MAX_MARKER, "commit marker")
    manifest_raw = read_bounded(step_dir / MANIFEST, MAX_MANIFEST, "manifest")
    manifest = read_manifest(step_dir, expected_step=step)
    marker = loads(marker_raw, f"commit marker {step_dir / MARKER}")
    if not isinstance(marker, dict) or marker.get("manifest_xxh3") != xxhash.xxh3_64_hexdigest(manifest_raw):
        raise CorruptCheckpointError(f"checkpoint {step_dir} changed while being read for upload")
    return marker_raw, manifest_raw, manifest


def upload_step(s3: Any, loc: S3Location, step_dir: Path, step: int, *, chunk: int | None = None,
                concurrency: int | None = None, settings: MirrorSettings | None = None,
                own: OwnAttempts | None = None) -> Transfer:
    """Copy the committed local `step_dir` to the bucket. Idempotent: a step whose marker is
    already there is left alone ("present" when it is the same commit, "conflict" when another
    run committed different bytes for that step). Raises CheckpointError on I/O failures; the
    step then stays invisible on the bucket (no marker). `chunk`/`concurrency`: part size and
    parts in flight (default: `upload.plan_upload` within `settings.upload_mib`). `own`: told
    this attempt's folder and how it ended (an abandoned attempt is its writer's to remove)."""
    started = time.perf_counter()
    settings = settings or MirrorSettings.from_env()
    marker_raw, manifest_raw, manifest = read_committed(step_dir, step)
    refuse_mirror(manifest.files, str(step_dir))  # before anything reaches the bucket
    existing = get_bounded(s3, loc, loc.key(step, MARKER), MAX_MARKER)
    if existing is not None:
        _sweep(s3, loc, step)
        return _already(step, existing, marker_raw, loc)
    attempt = new_attempt()  # this attempt's own keys: no other writer can overwrite or abort them
    plan = plan_upload(max((s["bytes"] for s in manifest.files), default=0), settings.upload_mib * MIB,
                       part=chunk, in_flight=concurrency)
    if own is not None:
        own.started(step, attempt)
    try:
        won, found = _attempt(s3, loc, step_dir, step, attempt, (marker_raw, manifest_raw), manifest, plan)
    except BaseException:
        if own is not None:
            own.abandoned(step, attempt)  # no request of it is in flight any more: upload_files waited
        raise
    if own is not None:
        (own.committed if won else own.abandoned)(step, attempt)
    if not won:
        _sweep(s3, loc, step)  # a loser removes its own folder
        existing = get_bounded(s3, loc, loc.key(step, MARKER), MAX_MARKER)
        return _already(step, existing or b"", marker_raw, loc)
    if found is None:
        _sweep(s3, loc, step)
    elif found.keys or found.uploads:
        _remove(s3, loc, step, found)
    return Transfer(step, "uploaded", manifest.total_bytes, time.perf_counter() - started)


def _attempt(s3: Any, loc: S3Location, step_dir: Path, step: int, attempt: str, raw: tuple[bytes, bytes],
             manifest: Manifest, plan: UploadPlan) -> tuple[bool, Garbage | None]:
    """Files and manifest into the folder `attempt`, then the marker naming it: (whether this
    marker won, the listing of other attempts taken beside the upload or None). `raw`: the
    marker's and the manifest's bytes."""
    marker_raw, manifest_raw = raw
    fds = {s["file"]: open_checked(step_dir, s["file"], s["bytes"]) for s in manifest.files}
    try:
        items = [Item(loc.key(step, f"{attempt}/{s['file']}"), s["bytes"], fd=fds[s["file"]],
                      what=str(step_dir / s["file"])) for s in manifest.files]
        # the manifest goes beside the files (nothing reads it before the marker names the folder)
        items.append(Item(loc.key(step, f"{attempt}/{MANIFEST}"), len(manifest_raw), data=manifest_raw,
                          what=f"the manifest of {loc.step_url(step)}"))
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="slurmresume-list") as side:
            seen = side.submit(garbage, s3, loc, step, attempt)  # what killed writers left, beside the upload
            upload_files(s3, loc, items, plan)
            found = _listed(seen, loc, step)
    finally:
        for fd in fds.values():
            os.close(fd)
    point("marker", loc.key(step, MARKER))
    return put_marker(s3, loc, step, marker_raw, folder=attempt), found


def _listed(seen: Future[Garbage], loc: S3Location, step: int) -> Garbage | None:
    """The listing taken beside the upload, or None when it failed (the full sweep runs then)."""
    try:
        return seen.result()
    except CheckpointError as exc:
        log.info("mirror: listing %s beside the upload failed (%s): swept after the commit", loc.step_url(step), exc)
        return None


def _remove(s3: Any, loc: S3Location, step: int, found: Garbage) -> None:
    try:
        removed = remove(s3, loc, step, found)
    except CheckpointError as exc:
        log.warning("mirror: losing uploads under %s not removed: %s", loc.step_url(step), exc)
        return
    log.info("mirror: removed %d object(s)/upload(s) no commit names under %s", removed, loc.step_url(step))


def _sweep(s3: Any, loc: S3Location, step: int) -> None:
    """`commit.sweep`, best effort: garbage left on the bucket never fails an upload."""
    try:
        removed = sweep(s3, loc, step)
    except CheckpointError as exc:
        log.warning("mirror: losing uploads under %s not removed: %s", loc.step_url(step), exc)
        return
    if removed:
        log.info("mirror: removed %d object(s)/upload(s) no commit names under %s", removed, loc.step_url(step))


def _already(step: int, existing: bytes, ours: bytes, loc: S3Location) -> Transfer:
    if existing == ours:
        return Transfer(step, "present")
    detail = (f"{loc.step_url(step)} is already committed with a different manifest (another run wrote this "
              "step): left as it is")
    log.warning("mirror: %s", detail)
    return Transfer(step, "conflict", detail=detail)


def read_local_marker(step_dir: Path) -> bytes | None:
    """The local commit marker's bytes, or None when it is missing or unreadable."""
    try:
        return read_bounded(step_dir / MARKER, MAX_MARKER, "commit marker")
    except (CheckpointError, OSError):
        return None


def download_step(s3: Any, loc: S3Location, step: int, root: Path, *, chunk: int | None = None,
                  workers: int = DOWNLOAD_WORKERS, replace_if_marker: bytes | None = None,
                  settings: MirrorSettings | None = None, deadline: float | None = None) -> Transfer:
    """Copy a committed step from the bucket into `root` (created if missing). Every shard is
    checked against the manifest's xxh3 before the step becomes visible; a mismatch raises
    CorruptCheckpointError and leaves nothing behind. "present" if the step is already there.
    `replace_if_marker`: the local copy failed to load; replace it, but only with the same
    commit (the bucket's marker has these bytes; CheckpointError otherwise). `chunk`: bytes
    per ranged GET (default: `download.part_size` of each shard's size)."""
    started = time.perf_counter()
    root = Path(root)
    final = root / step_dir_name(step)
    if replace_if_marker is None and inspect_dir(step, final).complete:
        return Transfer(step, "present")
    commit = read_remote_commit(s3, loc, step)
    marker_raw, manifest_raw, manifest = commit.marker_raw, commit.manifest_raw, commit.manifest
    refuse_mirror(manifest.files, loc.step_url(step))
    if replace_if_marker is not None and marker_raw != replace_if_marker:
        raise CheckpointError(f"{loc.step_url(step)} is another commit of step {step} than {final}: not used "
                              "to replace it")
    fsio.makedirs(root, 0o755)
    tmp = root / f"{DOWNLOAD_PREFIX}{step_dir_name(step)}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o755)
    try:
        fsio.write_durable(tmp / INPROGRESS, leftovers.note(), "mirror.note")  # who: checkpoint/leftovers.py
        settings = settings or MirrorSettings.from_env()
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slurmresume-get") as pool:
            for s in manifest.files:  # shards and (format 2) rank index files
                part = chunk or part_size(s["bytes"], workers)
                part = -(-part // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
                digest = fetch_shard(s3, loc, commit.key(loc, s["file"]), tmp / s["file"], s["bytes"], pool,
                                     part=part, settings=settings, deadline=deadline)
                if digest != s["xxh3"]:
                    raise CorruptCheckpointError(f"s3://{loc.bucket}/{commit.key(loc, s['file'])} fails its checksum "
                                                 f"after download (xxh3 {digest}, manifest {s['xxh3']}): not restored "
                                                 "from the mirror")
        fsio.write_durable(tmp / MANIFEST, manifest_raw, "mirror.manifest")
        fsio.write_durable(tmp / MARKER, marker_raw, "mirror.marker")
        with root_lock(root):
            if final.exists() or final.is_symlink():
                if replace_if_marker is None and inspect_dir(step, final).complete:
                    return Transfer(step, "present")
                move_aside(final, "mirror")  # an incomplete leftover of a killed save, or a damaged copy
            os.unlink(tmp / INPROGRESS)
            fsio.rename(tmp, final, "mirror.step")
            fsio.fsync_dir(root, "mirror.step")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Transfer(step, "downloaded", manifest.total_bytes, time.perf_counter() - started)

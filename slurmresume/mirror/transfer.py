"""Moving one committed step between a local root and the bucket, with the commit intact.

Upload (one process, rank 0): read and check the local marker + manifest, open every shard
(held open: a local prune during the upload cannot pull bytes out from under it), abort any
multipart upload a killed uploader left for this step, upload the shards (multipart, parallel,
bounded memory: `chunk * concurrency` bytes per shard in flight), then the manifest, then the
marker with `If-None-Match: *`, then read the marker's writer token back. The marker is the
last object written, so no reader sees the step complete before its files.

Download: marker + manifest checked first, shards fetched with parallel ranged GETs into a
hidden `.mirror-download.*` directory, every shard hashed and compared with the manifest,
manifest and marker written durably last, then one rename makes the step visible locally.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from ..checkpoint import fsio
from ..checkpoint.commit import move_aside, root_lock
from ..checkpoint.jsonenc import loads
from ..checkpoint.layout import MANIFEST, MARKER, step_dir_name
from ..checkpoint.manifest import (
    MAX_MANIFEST,
    MAX_MARKER,
    Manifest,
    pinned_manifest,
    read_bounded,
    read_manifest,
    validate_manifest,
)
from ..checkpoint.shard import hash_file, open_checked
from ..checkpoint.store import inspect_dir
from ..errors import CheckpointError, CorruptCheckpointError
from .s3 import WRITER_META, S3Location, abort_uploads, call, error_code, get_bounded, head, point

log = logging.getLogger("slurmresume")

CHUNK = 8 << 20  # multipart part size and ranged-GET size
CONCURRENCY = 4  # parts in flight per shard
# Downloads stream each range through a 1 MiB buffer, so their memory does not grow with the
# range size: larger ranges and more threads cost nothing and were faster here (fewer requests).
DOWNLOAD_CHUNK = 16 << 20
DOWNLOAD_WORKERS = 8
DOWNLOAD_PREFIX = ".mirror-download."


@dataclass(frozen=True)
class Transfer:
    step: int
    action: str  # "uploaded" | "present" (same marker already there) | "conflict" | "downloaded"
    bytes: int = 0
    seconds: float = 0.0
    detail: str = ""


def transfer_config(chunk: int = CHUNK, concurrency: int = CONCURRENCY) -> Any:
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=chunk, multipart_chunksize=chunk, max_concurrency=concurrency,
                          max_io_queue=concurrency * 2, use_threads=True)


def read_committed(step_dir: Path, step: int) -> tuple[bytes, bytes, Manifest]:
    """(marker bytes, manifest bytes, validated manifest) of a local committed step."""
    marker_raw = read_bounded(step_dir / MARKER, MAX_MARKER, "commit marker")
    manifest_raw = read_bounded(step_dir / MANIFEST, MAX_MANIFEST, "manifest")
    manifest = read_manifest(step_dir, expected_step=step)
    marker = loads(marker_raw, f"commit marker {step_dir / MARKER}")
    if not isinstance(marker, dict) or marker.get("manifest_xxh3") != xxhash.xxh3_64_hexdigest(manifest_raw):
        raise CorruptCheckpointError(f"checkpoint {step_dir} changed while being read for upload")
    return marker_raw, manifest_raw, manifest


def upload_step(s3: Any, loc: S3Location, step_dir: Path, step: int, *, chunk: int = CHUNK,
                concurrency: int = CONCURRENCY) -> Transfer:
    """Copy the committed local `step_dir` to the bucket. Idempotent: a step whose marker is
    already there is left alone ("present" when it is the same commit, "conflict" when another
    run committed different bytes for that step). Raises CheckpointError on I/O failures; the
    step then stays invisible on the bucket (no marker)."""
    started = time.perf_counter()
    marker_raw, manifest_raw, manifest = read_committed(step_dir, step)
    existing = get_bounded(s3, loc, loc.key(step, MARKER), MAX_MARKER)
    if existing is not None:
        return _already(step, existing, marker_raw, loc)
    fds = {s["file"]: open_checked(step_dir, s["file"], s["bytes"]) for s in manifest.shards}
    try:
        stale = abort_uploads(s3, loc, loc.step_prefix(step))
        if stale:
            log.info("mirror: aborted %d unfinished multipart upload(s) of %s", stale, loc.step_url(step))
        config = transfer_config(chunk, concurrency)
        for s in manifest.shards:
            key = loc.key(step, s["file"])
            with os.fdopen(os.dup(fds[s["file"]]), "rb") as f:
                point("shard", key)
                call(f"uploading {step_dir / s['file']} to s3://{loc.bucket}/{key}", s3.upload_fileobj, f,
                     loc.bucket, key, Config=config, Callback=lambda n, key=key: point("part", key))
    finally:
        for fd in fds.values():
            os.close(fd)
    point("manifest", loc.key(step, MANIFEST))
    call(f"uploading the manifest of {loc.step_url(step)}", s3.put_object, Bucket=loc.bucket,
         Key=loc.key(step, MANIFEST), Body=manifest_raw)
    point("marker", loc.key(step, MARKER))
    won = put_marker(s3, loc, step, marker_raw)
    if not won:
        existing = get_bounded(s3, loc, loc.key(step, MARKER), MAX_MARKER)
        return _already(step, existing or b"", marker_raw, loc)
    return Transfer(step, "uploaded", manifest.total_bytes, time.perf_counter() - started)


def put_marker(s3: Any, loc: S3Location, step: int, marker_raw: bytes, token: str | None = None) -> bool:
    """Write the commit marker only if none exists (`If-None-Match: *`), then read it back and
    compare the writer token: True when this writer's marker is the one stored. The read-back
    keeps the commit single-winner on a server that ignored the condition (no SeaweedFS
    version tested here does: 4.48 answers 412 to every loser)."""
    from botocore.exceptions import ClientError

    token = token or uuid.uuid4().hex
    key = loc.key(step, MARKER)
    try:
        s3.put_object(Bucket=loc.bucket, Key=key, Body=marker_raw, IfNoneMatch="*",
                      Metadata={WRITER_META: token})
    except ClientError as exc:
        if error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
            return False
        raise CheckpointError(f"writing the commit marker s3://{loc.bucket}/{key}: {error_code(exc)}") from exc
    stored = head(s3, loc, key)
    return stored is not None and (stored.get("Metadata") or {}).get(WRITER_META) == token


def _already(step: int, existing: bytes, ours: bytes, loc: S3Location) -> Transfer:
    if existing == ours:
        return Transfer(step, "present")
    detail = (f"{loc.step_url(step)} is already committed with a different manifest (another run wrote this "
              "step): left as it is")
    log.warning("mirror: %s", detail)
    return Transfer(step, "conflict", detail=detail)


def read_remote_commit(s3: Any, loc: S3Location, step: int) -> tuple[bytes, bytes, Manifest]:
    """(marker, manifest bytes, validated manifest) of a step on the bucket. Raises
    CorruptCheckpointError when the marker is missing or does not pin this manifest."""
    where = loc.step_url(step)
    marker_raw = get_bounded(s3, loc, loc.key(step, MARKER), MAX_MARKER)
    if marker_raw is None:
        raise CorruptCheckpointError(f"{where} has no commit marker (incomplete or being uploaded)")
    manifest_raw = get_bounded(s3, loc, loc.key(step, MANIFEST), MAX_MANIFEST)
    marker = loads(marker_raw, f"commit marker {where}/{MARKER}")
    data = pinned_manifest(marker, manifest_raw, where)  # a newer release's step: unreadable, not corrupt
    assert manifest_raw is not None  # pinned_manifest raised otherwise
    manifest = validate_manifest(data, Path(where), step)
    if marker.get("step") != manifest.step:
        raise CorruptCheckpointError(f"commit marker {where}/{MARKER} is for step {marker.get('step')!r}")
    return marker_raw, manifest_raw, manifest


def download_step(s3: Any, loc: S3Location, step: int, root: Path, *, chunk: int = DOWNLOAD_CHUNK,
                  workers: int = DOWNLOAD_WORKERS) -> Transfer:
    """Copy a committed step from the bucket into `root` (created if missing). Every shard is
    checked against the manifest's xxh3 before the step becomes visible; a mismatch raises
    CorruptCheckpointError and leaves nothing behind. "present" if the step is already there."""
    started = time.perf_counter()
    root = Path(root)
    final = root / step_dir_name(step)
    if inspect_dir(step, final).complete:
        return Transfer(step, "present")
    marker_raw, manifest_raw, manifest = read_remote_commit(s3, loc, step)
    fsio.makedirs(root, 0o755)
    tmp = root / f"{DOWNLOAD_PREFIX}{step_dir_name(step)}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(mode=0o755)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slurmresume-get") as pool:
            for s in manifest.shards:
                _fetch_shard(s3, loc, loc.key(step, s["file"]), tmp / s["file"], s["bytes"], chunk, pool)
        for s in manifest.shards:
            digest = hash_file(tmp, s["file"], s["bytes"])
            if digest != s["xxh3"]:
                raise CorruptCheckpointError(f"{loc.step_url(step)}/{s['file']} fails its checksum after download "
                                             f"(xxh3 {digest}, manifest {s['xxh3']}): not restored from the mirror")
        fsio.write_durable(tmp / MANIFEST, manifest_raw, "mirror.manifest")
        fsio.write_durable(tmp / MARKER, marker_raw, "mirror.marker")
        with root_lock(root):
            if final.exists() or final.is_symlink():
                if inspect_dir(step, final).complete:
                    return Transfer(step, "present")
                move_aside(final, "mirror")  # an incomplete leftover of a killed save
            fsio.rename(tmp, final, "mirror.step")
            fsio.fsync_dir(root, "mirror.step")
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return Transfer(step, "downloaded", manifest.total_bytes, time.perf_counter() - started)


def _fetch_shard(s3: Any, loc: S3Location, key: str, path: Path, size: int, chunk: int,
                 pool: ThreadPoolExecutor) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.ftruncate(fd, size)
        ranges = [(off, min(off + chunk, size)) for off in range(0, size, chunk)]
        for fut in [pool.submit(_fetch_range, s3, loc, key, fd, a, b) for a, b in ranges]:
            fut.result()
        fsio.fsync_fd(fd, "mirror.shard", path)
    finally:
        os.close(fd)


def _fetch_range(s3: Any, loc: S3Location, key: str, fd: int, start: int, end: int) -> None:
    obj = call(f"downloading s3://{loc.bucket}/{key}", s3.get_object, Bucket=loc.bucket, Key=key,
               Range=f"bytes={start}-{end - 1}")
    body, off = obj["Body"], start
    try:
        while off < end:
            data = body.read(min(1 << 20, end - off))
            if not data:
                raise CorruptCheckpointError(f"s3://{loc.bucket}/{key} ended at byte {off}, the manifest says more")
            _pwrite_all(fd, data, off)
            off += len(data)
    finally:
        body.close()


def _pwrite_all(fd: int, data: bytes, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n

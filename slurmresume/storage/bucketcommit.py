"""One step's commit on the bucket: which objects the marker names, and who may touch them.

A conditional write (`If-None-Match: *`) protects one key, the marker. So the objects it
commits must be out of every other writer's reach: each upload attempt writes its shards and
manifest under its own folder, `PREFIX/step_N/attempt-<token>/`, and writes the marker
`PREFIX/step_N/COMMITTED` last with that folder in its metadata (`slurmresume-objects`). A
losing writer only ever wrote into its own folder, which no marker names; readers resolve
every key through the marker (`RemoteCommit.key`), so they load the winner's objects only.

A marker without that metadata is the layout written before attempt folders (the files beside
the marker): still read as it is.

Once a step has a marker, no other attempt of it can ever commit, so everything under the
step that the marker does not name (losers' folders, their unfinished multipart uploads) is
garbage: `sweep` removes it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.jsonenc import loads
from ..checkpoint.layout import MANIFEST, MARKER
from ..checkpoint.manifest import (
    MAX_MANIFEST,
    MAX_MARKER,
    Manifest,
    pinned_manifest,
    refuse_newer,
    validate_manifest,
)
from ..errors import CheckpointError, CorruptCheckpointError
from .s3 import (
    WRITER_META,
    S3Location,
    call,
    error_code,
    get_bounded,
    get_with_metadata,
    head,
    list_objects,
)

OBJECTS_META = "slurmresume-objects"  # marker metadata: the attempt folder the commit's objects are in
ATTEMPT_PREFIX = "attempt-"
_ATTEMPT_RE = re.compile(r"attempt-[0-9a-f]{32}")


def new_attempt() -> str:
    """A folder name no other upload attempt will ever use."""
    return f"{ATTEMPT_PREFIX}{uuid.uuid4().hex}"


@dataclass(frozen=True)
class RemoteCommit:
    """A committed step on the bucket: marker and manifest (the marker pins the manifest's hash)
    and the folder that holds the committed objects ("" for the layout before attempt folders)."""

    step: int
    marker_raw: bytes
    manifest_raw: bytes
    manifest: Manifest
    folder: str

    def name(self, file: str) -> str:
        """`file`'s name relative to the step folder (what a listing shows)."""
        return f"{self.folder}/{file}" if self.folder else file

    def key(self, loc: S3Location, file: str) -> str:
        return loc.key(self.step, self.name(file))


def folder_of(metadata: dict[str, str], where: str) -> str:
    folder = metadata.get(OBJECTS_META, "")
    if folder and not _ATTEMPT_RE.fullmatch(folder):
        raise CorruptCheckpointError(f"commit marker {where}/{MARKER} names objects {folder!r}, not an attempt folder")
    return folder


def read_remote_commit(s3: Any, loc: S3Location, step: int) -> RemoteCommit:
    """The committed step `step` on the bucket. Raises CorruptCheckpointError when the marker is
    missing or does not pin the manifest of the folder it names."""
    where = loc.step_url(step)
    got = get_with_metadata(s3, loc, loc.key(step, MARKER), MAX_MARKER)
    if got is None:
        raise CorruptCheckpointError(f"{where} has no commit marker (incomplete or being uploaded)")
    marker_raw, metadata = got
    folder = folder_of(metadata, where)
    manifest_key = loc.key(step, f"{folder}/{MANIFEST}" if folder else MANIFEST)
    manifest_raw = get_bounded(s3, loc, manifest_key, MAX_MANIFEST)
    marker = loads(marker_raw, f"commit marker {where}/{MARKER}")
    if manifest_raw is None:
        refuse_newer(marker, where)  # a newer release may keep its manifest elsewhere
        raise CorruptCheckpointError(f"{where}: commit marker present but manifest s3://{loc.bucket}/{manifest_key} "
                                     "missing")
    data = pinned_manifest(marker, manifest_raw, where)  # a newer release's step: unreadable, not corrupt
    manifest = validate_manifest(data, Path(where), step)
    if marker.get("step") != manifest.step:
        raise CorruptCheckpointError(f"commit marker {where}/{MARKER} is for step {marker.get('step')!r}")
    return RemoteCommit(step, marker_raw, manifest_raw, manifest, folder)


def put_marker(s3: Any, loc: S3Location, step: int, marker_raw: bytes, token: str | None = None,
               folder: str = "") -> bool:
    """Write the commit marker only if none exists (`If-None-Match: *`), naming the attempt
    `folder` that holds its objects, then read it back and compare the writer token: True when
    this writer's marker is the one stored. The read-back keeps the commit single-winner on a
    server that ignored the condition (no SeaweedFS version tested here does: 4.48 answers 412
    to every loser)."""
    from botocore.exceptions import ClientError

    token = token or uuid.uuid4().hex
    key = loc.key(step, MARKER)
    metadata = {WRITER_META: token, **({OBJECTS_META: folder} if folder else {})}
    try:
        s3.put_object(Bucket=loc.bucket, Key=key, Body=marker_raw, IfNoneMatch="*", Metadata=metadata)
    except ClientError as exc:
        if error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
            return False
        raise CheckpointError(f"writing the commit marker s3://{loc.bucket}/{key}: {error_code(exc)}") from exc
    stored = head(s3, loc, key)
    return stored is not None and (stored.get("Metadata") or {}).get(WRITER_META) == token


def sweep(s3: Any, loc: S3Location, step: int) -> int:
    """Delete what the marker does not name under a committed step: other attempt folders and
    their unfinished multipart uploads (a loser's, a killed writer's). Only after the
    marker exists: no other attempt can commit then, so nothing removed here can ever be read.
    Returns how many objects and uploads were removed."""
    stored = head(s3, loc, loc.key(step, MARKER))
    if stored is None:
        return 0
    keep = folder_of(dict(stored.get("Metadata") or {}), loc.step_url(step))
    return remove(s3, loc, step, garbage(s3, loc, step, keep))


@dataclass(frozen=True)
class Garbage:
    """Objects and unfinished multipart uploads (key, UploadId) under a step that are in an
    attempt folder other than `keep`'s."""

    keep: str
    keys: tuple[str, ...] = ()
    uploads: tuple[tuple[str, str], ...] = ()


def garbage(s3: Any, loc: S3Location, step: int, keep: str) -> Garbage:
    """What `remove` would delete once the marker names `keep` (two listings). An uploader lists
    this beside its upload: if its marker wins, no other attempt can commit, and a writer racing
    it loses and removes its own folder, so the listing taken before the marker is all the
    winner has to remove."""
    prefix = loc.step_prefix(step)

    def other(key: str) -> bool:
        name = key[len(prefix):]
        folder = name.partition("/")[0] if "/" in name else ""
        return folder.startswith(ATTEMPT_PREFIX) and folder != keep

    keys = [o["Key"] for page in list_objects(s3, loc, prefix) for o in page.get("Contents") or []
            if other(o["Key"])]
    uploads = call(f"listing multipart uploads under {loc.step_url(step)}", s3.list_multipart_uploads,
                   Bucket=loc.bucket, Prefix=prefix).get("Uploads") or []
    return Garbage(keep, tuple(keys), tuple((u["Key"], u["UploadId"]) for u in uploads if other(u["Key"])))


def remove(s3: Any, loc: S3Location, step: int, found: Garbage) -> int:
    """Delete `found` (only while the step's marker names `found.keep`). Returns the count."""
    keys = list(found.keys)
    for i in range(0, len(keys), 1000):
        call(f"deleting losing uploads under {loc.step_url(step)}", s3.delete_objects, Bucket=loc.bucket,
             Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
    from botocore.exceptions import ClientError

    for key, upload_id in found.uploads:
        try:
            s3.abort_multipart_upload(Bucket=loc.bucket, Key=key, UploadId=upload_id)
        except ClientError as exc:  # its writer finished or aborted it since the listing: gone either way
            if error_code(exc) not in ("NoSuchUpload", "404"):
                raise CheckpointError(f"aborting a losing upload of s3://{loc.bucket}/{key}: {error_code(exc)}") \
                    from exc
    return len(keys) + len(found.uploads)

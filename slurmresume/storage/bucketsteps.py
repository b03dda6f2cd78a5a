"""A bucket root's reading and pruning: what `storage.BucketRoot` runs (checkpoint/store.py and
retention.py are the directory's). The record is the one of every tier (`CheckpointInfo`), the
plan the one of every tier (`retention.plan_prune`).

A step on the bucket is *complete* only when its marker exists, pins the manifest's hash, and
every shard object has the size the manifest records; `verify` also hashes every shard.
Retention reuses the pure `retention.plan_prune`; deletion is marker-first, so a step that
is half deleted is never complete, and re-planned just before each delete (there is no lock
on a bucket: the rules alone keep it safe, as on NFS).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from ..checkpoint.layout import MANIFEST, MARKER, parse_step_dir, step_dir_name
from ..checkpoint.store import CheckpointInfo
from ..errors import CheckpointError, UnreadableCheckpointError
from .bucketcommit import ATTEMPT_PREFIX, RemoteCommit, read_remote_commit
from .s3 import S3Location, call, list_objects, point

if TYPE_CHECKING:
    from ..retention import PruneResult


@dataclass
class RemoteStep:
    """What a listing shows of one step folder on the bucket."""

    step: int
    sizes: dict[str, int] = field(default_factory=dict)  # object name -> bytes
    mtime: float = 0.0  # newest LastModified (epoch seconds)
    uploading: bool = False  # an unfinished multipart upload exists under it
    upload_started: float = 0.0  # when the oldest of them was initiated (epoch seconds)

    @property
    def has_marker(self) -> bool:
        return MARKER in self.sizes


def scan(s3: Any, loc: S3Location) -> list[RemoteStep]:
    """Every step folder under the location, newest first (one listing, no object reads)."""
    base = f"{loc.prefix}/" if loc.prefix else ""
    found: dict[int, RemoteStep] = {}
    for page in list_objects(s3, loc, base):
        for obj in page.get("Contents") or []:
            rest = obj["Key"][len(base):]
            folder, _, name = rest.partition("/")
            step = parse_step_dir(folder)
            if step is None or not name or name.count("/") > 1 or ("/" in name and
                                                                    not name.startswith(ATTEMPT_PREFIX)):
                continue
            rs = found.setdefault(step, RemoteStep(step))
            rs.sizes[name] = int(obj["Size"])
            rs.mtime = max(rs.mtime, obj["LastModified"].timestamp())
    uploads = call(f"listing multipart uploads under {loc.url}", s3.list_multipart_uploads,
                   Bucket=loc.bucket, Prefix=base)
    for up in uploads.get("Uploads") or []:
        folder = up["Key"][len(base):].partition("/")[0]
        step = parse_step_dir(folder)
        if step is not None:
            rs = found.setdefault(step, RemoteStep(step))
            started = up["Initiated"].timestamp()
            rs.upload_started = min(rs.upload_started, started) if rs.uploading else started
            rs.uploading = True
            rs.mtime = max(rs.mtime, started)
    return sorted(found.values(), key=lambda r: r.step, reverse=True)


def inspect(s3: Any, loc: S3Location, rs: RemoteStep, verify: bool = False) -> CheckpointInfo:
    """Everything knowable about one remote step; never raises for a bad checkpoint. A newer
    format or a step over a read cap is `unreadable`: not corrupt, never deleted."""
    info = CheckpointInfo(rs.step, Path(step_dir_name(rs.step)), rs.has_marker, mtime=rs.mtime,
                          uploading=rs.uploading, location=loc.step_url(rs.step))
    if not rs.has_marker:
        info.problem = "no commit marker (incomplete or being uploaded)"
        return info
    try:
        commit = read_remote_commit(s3, loc, rs.step)
    except UnreadableCheckpointError as exc:
        info.problem, info.unreadable = str(exc), True
        return info
    except CheckpointError as exc:
        info.problem = str(exc)
        return info
    info.manifest = commit.manifest
    for s in info.manifest.files:
        if rs.sizes.get(commit.name(s["file"])) != s["bytes"]:
            info.problem = (f"shard {info.url}/{commit.name(s['file'])} is "
                            f"{rs.sizes.get(commit.name(s['file']), 'missing')} bytes, the manifest says {s['bytes']}")
            return info
    if verify:
        problems = [p for s in info.manifest.files if (p := _check_shard(s3, loc, commit, s))]
        info.verified = not problems
        info.problem = "; ".join(problems) or None
    return info


def _check_shard(s3: Any, loc: S3Location, commit: RemoteCommit, shard: dict[str, Any]) -> str | None:
    key = commit.key(loc, shard["file"])
    obj = call(f"reading s3://{loc.bucket}/{key}", s3.get_object, Bucket=loc.bucket, Key=key)
    hasher, body = xxhash.xxh3_64(), obj["Body"]
    try:
        for chunk in body.iter_chunks(1 << 20):
            hasher.update(chunk)
    finally:
        body.close()
    digest = hasher.hexdigest()
    if digest != shard["xxh3"]:
        return f"shard s3://{loc.bucket}/{key} fails its checksum (xxh3 {digest}, manifest {shard['xxh3']})"
    return None


def list_remote(s3: Any, loc: S3Location, verify: bool = False) -> list[CheckpointInfo]:
    return [inspect(s3, loc, rs, verify) for rs in scan(s3, loc)]


def find_latest(s3: Any, loc: S3Location, *, verify: bool = False, exclude: Collection[int] = (),
                steps: list[RemoteStep] | None = None) -> CheckpointInfo | None:
    """The newest complete step on the bucket (newest first, stopping at the first good one)."""
    for rs in steps if steps is not None else scan(s3, loc):
        if rs.step in exclude or not rs.has_marker:
            continue
        info = inspect(s3, loc, rs, verify)
        if info.complete:
            return info
    return None


def object_key(s3: Any, loc: S3Location, step: int, name: str) -> str:
    """The key of `name` (a shard or the manifest) in the commit the step's marker names."""
    return read_remote_commit(s3, loc, step).key(loc, name)


def delete_step(s3: Any, loc: S3Location, step: int) -> None:
    """Marker first (the step stops being complete at once), then the manifest and shards,
    then any unfinished multipart upload. A kill part-way leaves an incomplete step only."""
    from .s3 import abort_uploads

    prefix = loc.step_prefix(step)
    point("delete.marker", prefix)
    call(f"deleting {loc.step_url(step)}/{MARKER}", s3.delete_object, Bucket=loc.bucket, Key=prefix + MARKER)
    keys = [obj["Key"] for page in list_objects(s3, loc, prefix) for obj in page.get("Contents") or []]
    keys.sort(key=lambda k: k.endswith(MANIFEST))  # shards, then the manifest
    for i in range(0, len(keys), 1000):
        point("delete.objects", prefix)
        res = call(f"deleting {loc.step_url(step)}", s3.delete_objects, Bucket=loc.bucket,
                   Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
        if res.get("Errors"):
            err = res["Errors"][0]
            raise CheckpointError(f"deleting s3://{loc.bucket}/{err.get('Key')}: {err.get('Code')}")
    abort_uploads(s3, loc, prefix)


def records(s3: Any, loc: S3Location) -> list[Any]:
    """retention.CheckpointRecords for the bucket (an unfinished multipart upload = in progress)."""
    from ..checkpoint.jsonenc import decode
    from ..retention import CheckpointRecord

    out = []
    for info in list_remote(s3, loc):
        name = loc.step_url(info.step).rsplit("/", 1)[-1]
        if info.complete:
            assert info.manifest is not None
            try:
                metrics = decode(info.manifest.metrics)
            except Exception:  # odd metrics never block a prune
                metrics = None
            out.append(CheckpointRecord(info.step, name, True, True, False, info.mtime, metrics))
        else:
            out.append(CheckpointRecord(info.step, name, False, info.has_marker, info.uploading, info.mtime,
                                        unreadable=info.unreadable))
    return out


def plan(s3: Any, loc: S3Location, policy: Any, now: float | None = None) -> Any:
    from ..retention import plan_prune

    return plan_prune(records(s3, loc), policy, time.time() if now is None else now)


def prune(s3: Any, loc: S3Location, policy: Any, approved: Collection[str] | None = None,
          now: float | None = None, progress: Callable[[int, int], None] | None = None) -> PruneResult:
    """Delete per `policy`: re-list and re-plan first (another uploader may have committed
    since the plan the user saw), delete only what both plans delete, marker first. A
    retention.PruneResult (no leftovers to clean on a bucket)."""
    from ..retention import PruneResult

    fresh = plan(s3, loc, policy, now)
    result = PruneResult(fresh)
    chosen = {r.name for r in fresh.delete}
    for name in sorted(set(approved or ()) - chosen):
        result.skipped.append((name, "kept by the plan re-made just before deleting"))
    victims = [r for r in fresh.delete if approved is None or r.name in approved]
    for i, r in enumerate(victims, 1):
        if progress is not None:
            progress(i, len(victims))
        delete_step(s3, loc, r.step)
        result.deleted.append(r.name)
    return result

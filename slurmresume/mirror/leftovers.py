"""What killed transfers leave behind, and when it is safe to remove it.

On the bucket: a writer killed mid-upload leaves an unfinished multipart upload (shown as
"being uploaded" forever) and the objects of its attempt folder, which no marker names. A
bucket cannot say whether that writer is alive, so age is the evidence: an upload initiated,
or an attempt folder last written, more than `ABANDONED_AFTER_S` ago belongs to a writer that
is gone (every request is bounded by the settings' timeouts, and one upload of one step does
not take hours). A committed step's other folders are `commit.sweep`'s, at any age; a live
run's own failed attempts are its own to remove as soon as the bucket answers (own.py).

Locally: a pull killed mid-download leaves a hidden `.mirror-download.*` directory. The next
pull removes it by the rule every local leftover follows (`checkpoint.leftovers`): its
`.inprogress` note names the pulling process, which must be provably dead (a pid on this host
that exited), and the folder idle for the young threshold. Age alone is not evidence: a slow
pull's folder is kept however old its files are, and so is one whose writer ran on another node
(`status` lists it with its size).

`plan_*` decide (pure, `now` given); `remove_*` act.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.layout import MARKER, parse_step_dir
from ..checkpoint.leftovers import clean
from ..storage.bucketcommit import ATTEMPT_PREFIX
from ..storage.s3 import S3Location, call, list_objects
from .transfer import DOWNLOAD_PREFIX

log = logging.getLogger("slurmresume")

ABANDONED_AFTER_S = 6 * 3600.0


@dataclass(frozen=True)
class Upload:
    key: str
    upload_id: str
    initiated: float  # epoch seconds


def plan_uploads(uploads: list[Upload], now: float, older_than: float = ABANDONED_AFTER_S) -> list[Upload]:
    """The unfinished multipart uploads to abort: initiated more than `older_than` ago."""
    return [u for u in uploads if now - u.initiated > older_than]


def plan_folders(objects: list[tuple[str, float]], committed: Collection[int], now: float,
                 older_than: float = ABANDONED_AFTER_S) -> list[str]:
    """Keys (step-relative names "step_N/attempt-X/file", with their LastModified) of attempt
    folders to delete: in a step with no marker, every object of the folder older than
    `older_than`. (`committed`: the steps with a marker; those are commit.sweep's.)"""
    newest: dict[str, float] = {}
    for name, mtime in objects:
        parts = name.split("/")
        if len(parts) != 3 or not parts[1].startswith(ATTEMPT_PREFIX):
            continue
        step = parse_step_dir(parts[0])
        if step is None or step in committed:
            continue
        folder = f"{parts[0]}/{parts[1]}"
        newest[folder] = max(newest.get(folder, 0.0), mtime)
    stale = {f for f, t in newest.items() if now - t > older_than}
    return [name for name, _ in objects if name.rsplit("/", 1)[0] in stale]


def remove_abandoned(s3: Any, loc: S3Location, now: float, older_than: float = ABANDONED_AFTER_S) -> int:
    """Abort abandoned multipart uploads and delete abandoned attempt folders under `loc`.
    Returns how many uploads and objects were removed."""
    base = f"{loc.prefix}/" if loc.prefix else ""
    res = call(f"listing multipart uploads under {loc.url}", s3.list_multipart_uploads, Bucket=loc.bucket,
               Prefix=base)
    uploads = [Upload(u["Key"], u["UploadId"], u["Initiated"].timestamp()) for u in res.get("Uploads") or []]
    for u in plan_uploads(uploads, now, older_than):
        log.info("mirror: aborting the abandoned upload of s3://%s/%s (started %.0f s ago)", loc.bucket, u.key,
                 now - u.initiated)
        call(f"aborting the multipart upload of s3://{loc.bucket}/{u.key}", s3.abort_multipart_upload,
             Bucket=loc.bucket, Key=u.key, UploadId=u.upload_id)
    objects = [(o["Key"][len(base):], o["LastModified"].timestamp())
               for page in list_objects(s3, loc, base) for o in page.get("Contents") or []]
    committed = {step for name, _ in objects
                 if name.endswith(f"/{MARKER}") and (step := parse_step_dir(name.split("/")[0])) is not None}
    doomed = plan_folders(objects, committed, now, older_than)
    for i in range(0, len(doomed), 1000):
        call(f"deleting abandoned uploads under {loc.url}", s3.delete_objects, Bucket=loc.bucket,
             Delete={"Objects": [{"Key": base + k} for k in doomed[i:i + 1000]], "Quiet": True})
    return len(plan_uploads(uploads, now, older_than)) + len(doomed)


def remove_partial_downloads(root: Path, now: float | None = None) -> list[str]:
    """Delete the `.mirror-download.*` directories under `root` that killed pulls left (see the
    module docstring); their names."""
    from ..retention import DEFAULT_YOUNG_THRESHOLD

    return clean(Path(root), DEFAULT_YOUNG_THRESHOLD, now, prefixes=(DOWNLOAD_PREFIX,))

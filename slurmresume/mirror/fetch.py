"""A local copy of one committed bucket step, for the read-only commands (`inspect`, `export`).

`local_copy(root_url, which, headers_only=...)` resolves STEP / "latest" / a step URL on the
bucket, checks the step is complete there (marker pins the manifest, every shard object has
the manifest's size), and yields a temporary local step directory that the local code reads
exactly as it reads a root, so the output is the same:

- `headers_only=True` (plain `inspect`): marker, manifest and each shard's safetensors header
  (two ranged GETs per shard); the shard files are sparse, of the manifest's size, holding the
  header only. Nothing beyond the headers is read, as on a local root.
- otherwise (`export`, `inspect --tensors`): the whole step through `download_step`, so every
  shard's xxh3 is checked against the manifest before one byte is read. Never a pickle.

The copy is removed when the `with` block ends (or the process is killed: it lives in a
`tempfile` directory named `.slurmresume-fetch-*`).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint import fsio
from ..checkpoint.layout import MANIFEST, MARKER, step_dir_name
from ..checkpoint.shard import MAX_HEADER
from ..checkpoint.store import CheckpointInfo
from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError, UnsafeCheckpointError
from ..storage import BucketRoot, is_bucket
from ..storage.bucketcommit import read_remote_commit
from ..storage.s3 import S3Location, get_range, parse_s3_url, split_step_url
from .transfer import download_step


@dataclass(frozen=True)
class StepCopy:
    step: int
    path: Path  # the local step directory (temporary)
    url: str  # s3://BUCKET/PREFIX/step_...: what the commands print instead of `path`


def resolve(root: BucketRoot, which: str | int | None) -> CheckpointInfo:
    """The complete bucket step named by `which` (a step number or "latest"/None); one
    NoCheckpointError/CorruptCheckpointError line naming the URL otherwise."""
    loc = root.loc
    steps = root.listing()  # also the bucket check: a missing bucket is NoSuchBucket here
    if which is None or which == "latest":
        info = root.latest(listing=steps)
        if info is None:
            raise NoCheckpointError(f"no complete checkpoint under {loc.url}")
        return info
    if isinstance(which, str) and not re.fullmatch(r"\d+", which):
        raise ConfigError(f"{which!r} is not a step number, 'latest', or an s3:// step URL")
    step = int(which)
    found = [rs for rs in steps if rs.step == step]
    if not found:
        raise NoCheckpointError(f"no step {step} under {loc.url}: `slurmresume status --ckpt-dir {loc.url}` "
                                "lists them")
    info = root.inspect(step, listed=found[0])
    if not found[0].has_marker:
        raise NoCheckpointError(f"{info.url} is incomplete (no commit marker: being uploaded, or its upload "
                                f"was killed); `slurmresume latest --ckpt-dir {loc.url}` names the newest one")
    if not info.complete:
        raise CorruptCheckpointError(f"checkpoint {info.url} is corrupt: {info.problem}; "
                                     f"`slurmresume verify {step} --ckpt-dir {loc.url}` checks it")
    return info


def locate(which: str, root: object | None) -> tuple[S3Location, str | int | None]:
    """(location, step or "latest") for a command's WHICH + --ckpt-dir when either is s3://."""
    if is_bucket(which):
        loc, step = split_step_url(which)
        if step is None:
            return loc, "latest"  # the bucket root itself: its newest complete step
        return loc, step
    if root is None or not is_bucket(root):
        raise ConfigError(f"{which!r} is not an s3:// URL and --ckpt-dir is not one either")
    return parse_s3_url(str(root)), which


@contextmanager
def local_copy(loc: S3Location, which: str | int | None, *, headers_only: bool,
               parent: Path | None = None) -> Iterator[StepCopy]:
    """A temporary local copy of a complete bucket step (see the module docstring); `parent`
    is where the temporary directory goes (default: $TMPDIR)."""
    bucket = BucketRoot(loc)
    s3 = bucket.s3
    info = resolve(bucket, which)
    tmp = Path(tempfile.mkdtemp(prefix=".slurmresume-fetch-", dir=parent))
    try:
        if headers_only:
            _fetch_headers(s3, loc, info.step, tmp / step_dir_name(info.step))
        else:
            download_step(s3, loc, info.step, tmp)
        yield StepCopy(info.step, tmp / step_dir_name(info.step), info.url)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _fetch_headers(s3: Any, loc: S3Location, step: int, step_dir: Path) -> None:
    """Marker + manifest (checked: the marker pins the manifest), every shard's header, in
    sparse files of the manifest's sizes, and (format 2) every tensor index file."""
    commit = read_remote_commit(s3, loc, step)
    marker_raw, manifest_raw, manifest = commit.marker_raw, commit.manifest_raw, commit.manifest
    step_dir.mkdir(mode=0o755)
    for s in manifest.shards:
        key = commit.key(loc, s["file"])
        head = get_range(s3, loc, key, 0, min(8, s["bytes"]))
        if len(head) < 8:
            raise CorruptCheckpointError(f"s3://{loc.bucket}/{key} is too short to be safetensors")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > s["bytes"]:
            raise UnsafeCheckpointError(f"s3://{loc.bucket}/{key} claims a {n}-byte header: refused")
        raw = get_range(s3, loc, key, 8, 8 + n)
        fd = os.open(step_dir / s["file"], os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            os.ftruncate(fd, s["bytes"])
            os.pwrite(fd, head + raw, 0)
        finally:
            os.close(fd)
    for s in manifest.files[len(manifest.shards):]:  # format 2's tensor indexes: small, whole
        fsio.write_durable(step_dir / s["file"], get_range(s3, loc, commit.key(loc, s["file"]), 0, s["bytes"]),
                           "mirror.index", sync_dir=False)
    fsio.write_durable(step_dir / MANIFEST, manifest_raw, "mirror.manifest")
    fsio.write_durable(step_dir / MARKER, marker_raw, "mirror.marker")



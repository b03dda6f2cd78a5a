"""The one storage interface: a checkpoint root, wherever it lives, and the one place that tells
the places apart (`open_root`).

A root answers the same questions on a file system (`DirRoot`: checkpoint/store.py reads it,
retention.py prunes it under the root's lock) and in a bucket (`BucketRoot`: bucketsteps.py
reads and prunes it, marker first, with no lock), in the same format and the same words:

    url                      what the commands print for the root
    directory                the root's directory (its event log, lock, Slurm history); None: a bucket
    steps()                  the step numbers there, newest first (a listing: nothing read)
    inspect(step)            everything knowable about one step (`CheckpointInfo`; never raises
                             for a bad checkpoint)
    infos()                  every step inspected, newest first
    latest()                 the newest complete step, checked newest first
    read_marker(step)        the commit marker's bytes;  read_manifest(step): the checked manifest
    open_range(step, name, offset, length)   bytes of one file the manifest lists
    verify(step, every)      recompute checksums (`VerifyResult`s)
    records() / plan(...) / leftovers() / prune(...)   retention: the pure plan (retention.plan_prune),
                             then deletion by the root's own rules
    delete(step)             one step, crash-safe (a directory: one rename; a bucket: marker first)

Publishing stays with each tier's writer (checkpoint/commit.py renames a finished save into a
directory root; mirror/transfer.py uploads one with a conditional marker): they share the format,
not a code path. A third tier in host memory is a directory root on a tmpfs (/dev/shm): the same
`DirRoot`, nothing here changes. Commands, tools, restore and the mirror reach a root only
through this package (scripts/import_graph.py `storage_bypasses` holds it), and only `is_bucket`
looks at a URL's scheme. Here: the factory; `root` the contract, `directory` and `bucket` the tiers;
the bucket's side beneath `bucket`: `bucketsteps` (reading and pruning its steps), `bucketcommit`
(one step's commit on the bucket), `s3` (the object-store seam) and `settings` (its bounds). The
mirror (copying a root to a bucket and back) stands on this package, never the other way.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from ..checkpoint.store import CheckpointInfo
from ..errors import ConfigError
from .bucket import BucketRoot
from .directory import DirRoot
from .root import Root, VerifyResult

__all__ = ["BucketRoot", "CheckpointInfo", "DirRoot", "Root", "VerifyResult", "is_bucket", "open_root",
           "open_step_url"]


def is_bucket(value: object) -> bool:
    """True when `value` names a bucket root or step (`s3://...`): the one test of a root's kind."""
    from .s3 import is_s3_url

    return value is not None and is_s3_url(value)


def open_root(value: str | os.PathLike[str] | None, *,
              resolve: Callable[[Path | None], Path] | None = None) -> Root:
    """The root named by `value`: a bucket for an `s3://BUCKET/PREFIX` URL (ConfigError naming
    what is wrong with a malformed one; nothing is asked of the bucket yet), else a directory,
    `resolve(value)` when given (the command line's defaults and checks), else the path as is."""
    if is_bucket(value):
        from .s3 import parse_s3_url

        return BucketRoot(parse_s3_url(str(value)))
    path = Path(value) if value is not None and str(value) != "" else None
    if resolve is not None:
        return DirRoot(resolve(path))
    if path is None:
        raise ConfigError("no checkpoint root given")
    return DirRoot(path)


def open_step_url(value: str) -> tuple[BucketRoot, int | None]:
    """`s3://B/P` -> (its root, None); `s3://B/P/step_000001200` -> (the root of P, 1200)."""
    from .s3 import split_step_url

    loc, step = split_step_url(value)
    return BucketRoot(loc), step

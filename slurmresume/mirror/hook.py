"""The one function `Checkpointer` calls to get its mirror (kept here so the core edit is small)."""

from __future__ import annotations

import os
from typing import Any

from ..contract import ENV_MIRROR
from ..errors import ConfigError


def mirror_for(value: Any, *, rank: int, **kwargs: Any) -> Any:
    """`Checkpointer(mirror=...)`: the argument, else $SLURMRESUME_MIRROR (set by `submit
    --mirror`). Every rank validates the URL (a bad one is a ConfigError everywhere); only
    rank 0 gets a `Mirror` (it commits, so it uploads; the local root is shared)."""
    if value is None:
        value = os.environ.get(ENV_MIRROR) or None
    if value is None:
        return None  # no mirror: nothing of slurmresume.mirror's transfer code is imported
    from ..storage.s3 import S3Location, parse_s3_url
    from .background import Mirror

    if isinstance(value, Mirror):
        return value if rank == 0 else None
    if not isinstance(value, (str, os.PathLike, S3Location)):
        raise ConfigError(f"mirror must be an s3:// URL, got {type(value).__name__}")
    loc = value if isinstance(value, S3Location) else parse_s3_url(value)
    return Mirror(loc, **kwargs) if rank == 0 else None


def refuse_bucket_root(value: object, how: str) -> None:
    """A checkpoint root must be a filesystem path: an `s3://` root is refused with the way to
    get the bucket copy (`how` is how the user spells the mirror: "--mirror" or "mirror=").

    Why not a bucket-only root: every rank writes its own shard into the root and rank 0
    commits once they are all there, so the root must be one directory every rank writes to;
    and a bucket-only emergency save would last as long as the whole upload (measured in the
    issue-19 note), inside the preemption's grace time."""
    from ..storage import is_bucket

    if not is_bucket(value):
        return
    from ..storage.s3 import parse_s3_url

    try:
        url = parse_s3_url(str(value)).url
    except ConfigError:
        url = str(value)
    example = (f"--ckpt-dir /scratch/run1 --mirror {url}" if how == "--mirror"
               else f"Checkpointer('/scratch/run1', mirror='{url}')")
    raise ConfigError(f"checkpoint root {url} is a bucket: the root must be a directory every rank can write "
                      f"(saves land there first, fast); give one and put the bucket in {how}, e.g. {example}")



def exit_behind(mirror: Any, root: Any = None) -> None:
    """Rank 0, at the very end of `Checkpointer.close()` when the last committed step is not on
    the bucket (the server down or stalled past the close deadline, the upload tried again):
    one line on stderr, then `SystemExit(EXIT_MIRROR_BEHIND)`, so the run's exit status says
    the bucket does not hold it (the user's `finally` blocks and atexit handlers still run; a
    script that must go on can catch it). The `mirror_behind` event is already in the log, and
    the next run with this mirror uploads the step (`Mirror.start`). Under the launcher
    (`$SLURMRESUME_RUN_ID`) a record under `root` tells it so (torchrun turns the status into 1)."""
    import sys

    from ..contract import ENV_RUN_ID, EXIT_MIRROR_BEHIND, write_mirror_behind

    step, why = mirror.behind or (None, "?")
    run_id = os.environ.get(ENV_RUN_ID)
    if run_id and root is not None:
        try:
            write_mirror_behind(root, run_id, step, why)
        except (OSError, ValueError) as exc:
            print(f"slurmresume: could not record the mirror's lag for the launcher: {exc}", file=sys.stderr)
    print(f"slurmresume: step {step} is not on the mirror {mirror.loc.url} ({why}); exiting with status "
          f"{EXIT_MIRROR_BEHIND}: the next run with this mirror uploads it", file=sys.stderr, flush=True)
    raise SystemExit(EXIT_MIRROR_BEHIND)

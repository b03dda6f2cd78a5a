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
    from .background import Mirror
    from .s3 import S3Location, parse_s3_url

    if isinstance(value, Mirror):
        return value if rank == 0 else None
    if not isinstance(value, (str, os.PathLike, S3Location)):
        raise ConfigError(f"mirror must be an s3:// URL, got {type(value).__name__}")
    loc = value if isinstance(value, S3Location) else parse_s3_url(value)
    return Mirror(loc, **kwargs) if rank == 0 else None

"""`verify`: recompute the shard checksums of one, the newest or every committed step of a root
(`storage.Root.verify`: the same on a directory and a bucket)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..storage import DirRoot, VerifyResult

__all__ = ["VerifyResult", "verify_checkpoints"]


def verify_checkpoints(root: Path, step: int | None = None, every: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> list[VerifyResult]:
    """Recompute shard checksums of directory root `root`: of `step`, of every marked directory
    (`every`), or of the newest complete one. Each problem names the bad file. Raises
    NoCheckpointError / ConfigError when there is nothing to verify."""
    return DirRoot(Path(root)).verify(step=step, every=every, progress=progress)

"""A checkpoint root on a file system (a shared disk, node-local scratch, or a tmpfs such as
/dev/shm: the memory tier is this, nothing more): checkpoint/store.py reads it, retention.py
prunes it under the root's lock."""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.layout import MARKER, step_dir_name
from ..checkpoint.store import CheckpointInfo
from ..errors import ConfigError, NoCheckpointError
from .root import Progress, VerifyResult

if TYPE_CHECKING:
    from ..checkpoint.manifest import Manifest
    from ..retention import CheckpointRecord, PrunePlan, PruneResult, RetentionPolicy


class DirRoot:
    """A root on a file system (a shared disk, node-local scratch, or a tmpfs such as /dev/shm)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.directory: Path | None = Path(path)
        self.path = Path(path)
        self.url = os.fspath(self.path)

    def __repr__(self) -> str:
        return f"DirRoot({self.url!r})"

    def step_path(self, step: int) -> Path:
        return self.path / step_dir_name(step)

    def steps(self) -> list[int]:
        from ..checkpoint.layout import step_dirs

        return [step for step, _ in step_dirs(self.path)]

    def inspect(self, step: int, *, verify: bool = False, scan: bool = False, sizes: bool = True) -> CheckpointInfo:
        from ..checkpoint.store import inspect_dir

        return inspect_dir(step, self.step_path(step), verify, scan, sizes=sizes)

    def infos(self, *, verify: bool = False, scan: bool = False) -> list[CheckpointInfo]:
        from ..checkpoint.store import list_checkpoints

        return list_checkpoints(self.path, verify=verify, scan=scan)

    def latest(self, *, verify: bool = False, exclude: Collection[int] = (), max_step: int | None = None,
               scan: bool = False, sizes: bool = True, warn: bool = False,
               skipped: Callable[[CheckpointInfo], None] | None = None) -> CheckpointInfo | None:
        """The newest complete step (store.find_latest; a newer step this version cannot read
        raises UnreadableCheckpointError rather than resuming past it). `warn`: log a warning
        naming each newer step passed over, and why."""
        from ..checkpoint.store import find_latest

        return find_latest(self.path, verify=verify, exclude=set(exclude), max_step=max_step, warn=warn,
                           scan=scan, sizes=sizes, skipped=skipped)

    def read_marker(self, step: int) -> bytes:
        from ..checkpoint.manifest import MAX_MARKER, read_bounded

        return read_bounded(self.step_path(step) / MARKER, MAX_MARKER, "commit marker")

    def read_manifest(self, step: int) -> Manifest:
        from ..checkpoint.manifest import read_manifest

        return read_manifest(self.step_path(step), expected_step=step)

    def open_range(self, step: int, name: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of file `name` of the step (a plain name, as a manifest lists)."""
        from ..checkpoint.shardread import check_name
        from ..errors import CorruptCheckpointError

        where = self.step_path(step)
        check_name(where, name)
        fd = os.open(where / name, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            data = os.pread(fd, length, offset)
        finally:
            os.close(fd)
        if len(data) != length:
            raise CorruptCheckpointError(f"{where / name} ended at byte {offset + len(data)}, the manifest says more")
        return data

    def verify(self, step: int | None = None, every: bool = False,
               progress: Progress | None = None) -> list[VerifyResult]:
        """Recompute shard checksums: of `step`, of every marked directory (`every`), or of the
        newest complete one. Each problem names the bad file. Raises NoCheckpointError /
        ConfigError when there is nothing to verify."""
        from ..checkpoint.store import UNREADABLE

        root = self.path
        if not root.is_dir():
            raise ConfigError(f"checkpoint root {root} does not exist: pass --ckpt-dir or set SLURMRESUME_CKPT_DIR")
        if every:
            infos = [i for i in self.infos() if i.has_marker or i.unreadable
                     or (i.problem or "").startswith(UNREADABLE)]
        elif step is not None:
            infos = [self.inspect(step)]
            if not infos[0].path.is_dir():
                raise NoCheckpointError(f"no step {step} under {root}: `slurmresume status --ckpt-dir {root}` lists them")
            if not infos[0].has_marker:
                raise NoCheckpointError(f"step {step} under {root} is incomplete (no commit marker): nothing to verify")
        else:
            latest = self.latest()
            infos = [latest] if latest is not None else []
        if not infos:
            raise NoCheckpointError(f"no complete checkpoint under {root} to verify")
        out = []
        for done, info in enumerate(infos, 1):
            out.append(_verify_dir(info))
            if progress is not None:
                progress(done, len(infos))
        return out

    def records(self) -> list[CheckpointRecord]:
        from ..retention import scan

        return scan(self.path)

    def plan(self, records: Iterable[CheckpointRecord], policy: RetentionPolicy, now: float) -> PrunePlan:
        """retention.plan_checked: the steps the plan keeps have their shard sizes checked."""
        from ..retention import plan_checked

        return plan_checked(self.path, list(records), policy, now)

    def leftovers(self) -> list[str]:
        from ..retention import leftovers

        return leftovers(self.path)

    def prune(self, policy: RetentionPolicy, approved: Collection[str] | None = None, *,
              progress: Progress | None = None) -> PruneResult:
        from ..retention import execute

        return execute(self.path, policy, approved=approved, progress=progress)

    def delete(self, step: int) -> None:
        """One step, renamed away under the root's lock, then removed (as a prune does)."""
        import shutil

        from ..checkpoint.commit import hide
        from ..retention import locked

        with locked(self.path, 30.0):
            hidden = hide(self.step_path(step), "prune")
        shutil.rmtree(hidden, ignore_errors=True)


def _verify_dir(info: CheckpointInfo) -> VerifyResult:
    from ..checkpoint.store import check_checksums

    if info.manifest is None:
        return VerifyResult(info.step, str(info.path), False,
                            [f"{info.path.name}: {info.problem or 'unreadable manifest'}"], unreadable=info.unreadable)
    problems = check_checksums(info.path, info.manifest)
    return VerifyResult(info.step, str(info.path), not problems, problems)

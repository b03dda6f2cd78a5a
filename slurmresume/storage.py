"""The one storage interface: a checkpoint root, wherever it lives, and the one place that tells
the places apart (`open_root`).

A root answers the same questions on a file system (`DirRoot`: checkpoint/store.py reads it,
retention.py prunes it under the root's lock) and in a bucket (`BucketRoot`: mirror/remote.py
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
through this module (scripts/import_graph.py `storage_bypasses` holds it), and only `is_bucket`
looks at a URL's scheme.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .checkpoint.layout import MARKER, step_dir_name
from .checkpoint.store import CheckpointInfo
from .errors import ConfigError, NoCheckpointError

if TYPE_CHECKING:
    from .checkpoint.manifest import Manifest
    from .mirror.remote import RemoteStep
    from .mirror.s3 import S3Location
    from .retention import CheckpointRecord, PrunePlan, PruneResult, RetentionPolicy

Progress = Callable[[int, int], None]
log = logging.getLogger("slurmresume")

__all__ = ["BucketRoot", "CheckpointInfo", "DirRoot", "Root", "VerifyResult", "is_bucket", "open_root"]


@dataclass
class VerifyResult:
    step: int
    path: str  # the step directory, or the step's URL on a bucket
    ok: bool
    problems: list[str]
    unreadable: bool = False  # not checked: this version cannot read it (newer format, over a cap); not corrupt


class Root(Protocol):
    """A checkpoint root (see the module docstring)."""

    url: str
    directory: Path | None

    def steps(self) -> list[int]: ...

    def inspect(self, step: int, *, verify: bool = False, scan: bool = False, sizes: bool = True) -> CheckpointInfo: ...

    def infos(self, *, verify: bool = False, scan: bool = False) -> list[CheckpointInfo]: ...

    def latest(self, *, verify: bool = False, exclude: Collection[int] = (), max_step: int | None = None,
               scan: bool = False, sizes: bool = True, warn: bool = False,
               skipped: Callable[[CheckpointInfo], None] | None = None) -> CheckpointInfo | None: ...

    def read_marker(self, step: int) -> bytes: ...

    def read_manifest(self, step: int) -> Manifest: ...

    def open_range(self, step: int, name: str, offset: int, length: int) -> bytes: ...

    def verify(self, step: int | None = None, every: bool = False,
               progress: Progress | None = None) -> list[VerifyResult]: ...

    def records(self) -> list[CheckpointRecord]: ...

    def plan(self, records: Iterable[CheckpointRecord], policy: RetentionPolicy, now: float) -> PrunePlan: ...

    def leftovers(self) -> list[str]: ...

    def prune(self, policy: RetentionPolicy, approved: Collection[str] | None = None, *,
              progress: Progress | None = None) -> PruneResult: ...

    def delete(self, step: int) -> None: ...


def is_bucket(value: object) -> bool:
    """True when `value` names a bucket root or step (`s3://...`): the one test of a root's kind."""
    from .mirror.s3 import is_s3_url

    return value is not None and is_s3_url(value)


def open_root(value: str | os.PathLike[str] | None, *,
              resolve: Callable[[Path | None], Path] | None = None) -> Root:
    """The root named by `value`: a bucket for an `s3://BUCKET/PREFIX` URL (ConfigError naming
    what is wrong with a malformed one; nothing is asked of the bucket yet), else a directory,
    `resolve(value)` when given (the command line's defaults and checks), else the path as is."""
    if is_bucket(value):
        from .mirror.s3 import parse_s3_url

        return BucketRoot(parse_s3_url(str(value)))
    path = Path(value) if value is not None and str(value) != "" else None
    if resolve is not None:
        return DirRoot(resolve(path))
    if path is None:
        raise ConfigError("no checkpoint root given")
    return DirRoot(path)


def open_step_url(value: str) -> tuple[BucketRoot, int | None]:
    """`s3://B/P` -> (its root, None); `s3://B/P/step_000001200` -> (the root of P, 1200)."""
    from .mirror.s3 import split_step_url

    loc, step = split_step_url(value)
    return BucketRoot(loc), step


# -- a directory --------------------------------------------------------------------------------


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
        from .checkpoint.layout import step_dirs

        return [step for step, _ in step_dirs(self.path)]

    def inspect(self, step: int, *, verify: bool = False, scan: bool = False, sizes: bool = True) -> CheckpointInfo:
        from .checkpoint.store import inspect_dir

        return inspect_dir(step, self.step_path(step), verify, scan, sizes=sizes)

    def infos(self, *, verify: bool = False, scan: bool = False) -> list[CheckpointInfo]:
        from .checkpoint.store import list_checkpoints

        return list_checkpoints(self.path, verify=verify, scan=scan)

    def latest(self, *, verify: bool = False, exclude: Collection[int] = (), max_step: int | None = None,
               scan: bool = False, sizes: bool = True, warn: bool = False,
               skipped: Callable[[CheckpointInfo], None] | None = None) -> CheckpointInfo | None:
        """The newest complete step (store.find_latest; a newer step this version cannot read
        raises UnreadableCheckpointError rather than resuming past it). `warn`: log a warning
        naming each newer step passed over, and why."""
        from .checkpoint.store import find_latest

        return find_latest(self.path, verify=verify, exclude=set(exclude), max_step=max_step, warn=warn,
                           scan=scan, sizes=sizes, skipped=skipped)

    def read_marker(self, step: int) -> bytes:
        from .checkpoint.manifest import MAX_MARKER, read_bounded

        return read_bounded(self.step_path(step) / MARKER, MAX_MARKER, "commit marker")

    def read_manifest(self, step: int) -> Manifest:
        from .checkpoint.manifest import read_manifest

        return read_manifest(self.step_path(step), expected_step=step)

    def open_range(self, step: int, name: str, offset: int, length: int) -> bytes:
        """`length` bytes at `offset` of file `name` of the step (a plain name, as a manifest lists)."""
        from .checkpoint.shardread import check_name
        from .errors import CorruptCheckpointError

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
        from .checkpoint.store import UNREADABLE

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
        from .retention import scan

        return scan(self.path)

    def plan(self, records: Iterable[CheckpointRecord], policy: RetentionPolicy, now: float) -> PrunePlan:
        """retention.plan_checked: the steps the plan keeps have their shard sizes checked."""
        from .retention import plan_checked

        return plan_checked(self.path, list(records), policy, now)

    def leftovers(self) -> list[str]:
        from .retention import leftovers

        return leftovers(self.path)

    def prune(self, policy: RetentionPolicy, approved: Collection[str] | None = None, *,
              progress: Progress | None = None) -> PruneResult:
        from .retention import execute

        return execute(self.path, policy, approved=approved, progress=progress)

    def delete(self, step: int) -> None:
        """One step, renamed away under the root's lock, then removed (as a prune does)."""
        import shutil

        from .checkpoint.commit import hide
        from .retention import locked

        with locked(self.path, 30.0):
            hidden = hide(self.step_path(step), "prune")
        shutil.rmtree(hidden, ignore_errors=True)


def _verify_dir(info: CheckpointInfo) -> VerifyResult:
    from .checkpoint.store import check_checksums

    if info.manifest is None:
        return VerifyResult(info.step, str(info.path), False,
                            [f"{info.path.name}: {info.problem or 'unreadable manifest'}"], unreadable=info.unreadable)
    problems = check_checksums(info.path, info.manifest)
    return VerifyResult(info.step, str(info.path), not problems, problems)


# -- a bucket -----------------------------------------------------------------------------------


class BucketRoot:
    """A root in an S3 bucket (`s3://BUCKET/PREFIX`): the mirror's copy of a run, or a run moved
    between clusters. The client is made on first use (boto3 and the AWS settings)."""

    directory: Path | None = None

    def __init__(self, loc: S3Location, s3: Any = None, settings: Any = None) -> None:
        self.loc = loc
        self.url = loc.url
        self._s3 = s3
        self._settings = settings

    def __repr__(self) -> str:
        return f"BucketRoot({self.url!r})"

    @property
    def s3(self) -> Any:
        if self._s3 is None:
            from .mirror.s3 import client

            self._s3 = client(self._settings)
        return self._s3

    def listing(self) -> list[RemoteStep]:
        """One listing of the step folders, newest first (sizes, uploads in flight; no object read)."""
        from .mirror import remote

        return remote.scan(self.s3, self.loc)

    def steps(self) -> list[int]:
        return [rs.step for rs in self.listing()]

    def inspect(self, step: int, *, verify: bool = False, scan: bool = False, sizes: bool = True,
                listed: RemoteStep | None = None) -> CheckpointInfo:
        """`listed`: this step's entry of a listing already made (else one is made)."""
        from .mirror import remote

        if listed is None:
            listed = next((rs for rs in self.listing() if rs.step == step), None) or remote.RemoteStep(step)
        return remote.inspect(self.s3, self.loc, listed, verify)

    def infos(self, *, verify: bool = False, scan: bool = False) -> list[CheckpointInfo]:
        from .mirror import remote

        return remote.list_remote(self.s3, self.loc, verify)

    def latest(self, *, verify: bool = False, exclude: Collection[int] = (), max_step: int | None = None,
               scan: bool = False, sizes: bool = True, warn: bool = False,
               skipped: Callable[[CheckpointInfo], None] | None = None,
               listing: list[RemoteStep] | None = None) -> CheckpointInfo | None:
        """The newest complete step (a step without a marker is passed over unread). `listing`:
        one already made. `scan` and `sizes` change nothing here: a bucket step is always judged
        by its marker, manifest and the listed sizes."""
        from .mirror import remote

        for rs in listing if listing is not None else self.listing():
            if rs.step in exclude or not rs.has_marker or (max_step is not None and rs.step > max_step):
                continue
            info = remote.inspect(self.s3, self.loc, rs, verify)
            if info.complete:
                return info
            if warn:
                log.warning("skipping %s: %s", info.url, info.problem)
            if skipped is not None:
                skipped(info)
        return None

    def read_marker(self, step: int) -> bytes:
        from .mirror.commit import read_remote_commit

        return read_remote_commit(self.s3, self.loc, step).marker_raw

    def read_manifest(self, step: int) -> Manifest:
        from .mirror.commit import read_remote_commit

        return read_remote_commit(self.s3, self.loc, step).manifest

    def open_range(self, step: int, name: str, offset: int, length: int) -> bytes:
        from .mirror.remote import object_key
        from .mirror.s3 import get_range

        return get_range(self.s3, self.loc, object_key(self.s3, self.loc, step, name), offset, offset + length)

    def verify(self, step: int | None = None, every: bool = False,
               progress: Progress | None = None) -> list[VerifyResult]:
        """Hash every shard object of the chosen step(s) against its manifest."""
        from .mirror import remote

        steps = self.listing()
        if every:
            chosen = [rs for rs in steps if rs.has_marker]
        elif step is not None:
            chosen = [rs for rs in steps if rs.step == step]
            if not chosen:
                raise NoCheckpointError(f"no step {step} under {self.url}")
            if not chosen[0].has_marker:
                raise NoCheckpointError(f"step {step} under {self.url} is incomplete (no commit marker): "
                                        "nothing to verify")
        else:
            newest = self.latest(listing=steps)
            chosen = [rs for rs in steps if newest is not None and rs.step == newest.step]
        if not chosen:
            raise NoCheckpointError(f"no complete checkpoint under {self.url} to verify")
        results = []
        for done, rs in enumerate(chosen, 1):
            info = remote.inspect(self.s3, self.loc, rs, verify=True)
            results.append(VerifyResult(rs.step, info.url, info.complete, [info.problem] if info.problem else []))
            if progress is not None:
                progress(done, len(chosen))
        return results

    def records(self) -> list[CheckpointRecord]:
        from .mirror import remote

        return remote.records(self.s3, self.loc)

    def plan(self, records: Iterable[CheckpointRecord], policy: RetentionPolicy, now: float) -> PrunePlan:
        from .retention import plan_prune

        return plan_prune(list(records), policy, now)

    def leftovers(self) -> list[str]:
        return []  # a bucket has no half-renamed deletions: marker-first deletion leaves incomplete steps

    def prune(self, policy: RetentionPolicy, approved: Collection[str] | None = None, *,
              progress: Progress | None = None) -> PruneResult:
        from .mirror import remote

        return remote.prune(self.s3, self.loc, policy, approved=approved, progress=progress)

    def delete(self, step: int) -> None:
        from .mirror import remote

        remote.delete_step(self.s3, self.loc, step)

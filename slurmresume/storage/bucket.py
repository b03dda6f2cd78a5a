"""A checkpoint root in an S3 bucket (`s3://BUCKET/PREFIX`): bucketsteps.py reads and prunes
it (marker first, no lock), bucketcommit.py reads its commits."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.store import CheckpointInfo
from ..errors import NoCheckpointError
from .root import Progress, VerifyResult

if TYPE_CHECKING:
    from ..checkpoint.manifest import Manifest
    from ..retention import CheckpointRecord, PrunePlan, PruneResult, RetentionPolicy
    from .bucketsteps import RemoteStep
    from .s3 import S3Location

log = logging.getLogger("slurmresume")


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
            from .s3 import client

            self._s3 = client(self._settings)
        return self._s3

    def listing(self) -> list[RemoteStep]:
        """One listing of the step folders, newest first (sizes, uploads in flight; no object read)."""
        from . import bucketsteps

        return bucketsteps.scan(self.s3, self.loc)

    def steps(self) -> list[int]:
        return [rs.step for rs in self.listing()]

    def inspect(self, step: int, *, verify: bool = False, scan: bool = False, sizes: bool = True,
                listed: RemoteStep | None = None) -> CheckpointInfo:
        """`listed`: this step's entry of a listing already made (else one is made)."""
        from . import bucketsteps

        if listed is None:
            listed = next((rs for rs in self.listing() if rs.step == step), None) or bucketsteps.RemoteStep(step)
        return bucketsteps.inspect(self.s3, self.loc, listed, verify)

    def infos(self, *, verify: bool = False, scan: bool = False) -> list[CheckpointInfo]:
        from . import bucketsteps

        return bucketsteps.list_remote(self.s3, self.loc, verify)

    def latest(self, *, verify: bool = False, exclude: Collection[int] = (), max_step: int | None = None,
               scan: bool = False, sizes: bool = True, warn: bool = False,
               skipped: Callable[[CheckpointInfo], None] | None = None,
               listing: list[RemoteStep] | None = None) -> CheckpointInfo | None:
        """The newest complete step (a step without a marker is passed over unread). `listing`:
        one already made. `scan` and `sizes` change nothing here: a bucket step is always judged
        by its marker, manifest and the listed sizes."""
        from . import bucketsteps

        for rs in listing if listing is not None else self.listing():
            if rs.step in exclude or not rs.has_marker or (max_step is not None and rs.step > max_step):
                continue
            info = bucketsteps.inspect(self.s3, self.loc, rs, verify)
            if info.complete:
                return info
            if warn:
                log.warning("skipping %s: %s", info.url, info.problem)
            if skipped is not None:
                skipped(info)
        return None

    def read_marker(self, step: int) -> bytes:
        from .bucketcommit import read_remote_commit

        return read_remote_commit(self.s3, self.loc, step).marker_raw

    def read_manifest(self, step: int) -> Manifest:
        from .bucketcommit import read_remote_commit

        return read_remote_commit(self.s3, self.loc, step).manifest

    def open_range(self, step: int, name: str, offset: int, length: int) -> bytes:
        from .bucketsteps import object_key
        from .s3 import get_range

        return get_range(self.s3, self.loc, object_key(self.s3, self.loc, step, name), offset, offset + length)

    def verify(self, step: int | None = None, every: bool = False,
               progress: Progress | None = None) -> list[VerifyResult]:
        """Hash every shard object of the chosen step(s) against its manifest."""
        from . import bucketsteps

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
            info = bucketsteps.inspect(self.s3, self.loc, rs, verify=True)
            results.append(VerifyResult(rs.step, info.url, info.complete, [info.problem] if info.problem else []))
            if progress is not None:
                progress(done, len(chosen))
        return results

    def records(self) -> list[CheckpointRecord]:
        from . import bucketsteps

        return bucketsteps.records(self.s3, self.loc)

    def plan(self, records: Iterable[CheckpointRecord], policy: RetentionPolicy, now: float) -> PrunePlan:
        from ..retention import plan_prune

        return plan_prune(list(records), policy, now)

    def leftovers(self) -> list[str]:
        return []  # a bucket has no half-renamed deletions: marker-first deletion leaves incomplete steps

    def prune(self, policy: RetentionPolicy, approved: Collection[str] | None = None, *,
              progress: Progress | None = None) -> PruneResult:
        from . import bucketsteps

        return bucketsteps.prune(self.s3, self.loc, policy, approved=approved, progress=progress)

    def delete(self, step: int) -> None:
        from . import bucketsteps

        bucketsteps.delete_step(self.s3, self.loc, step)

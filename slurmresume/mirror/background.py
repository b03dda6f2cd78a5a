"""`Mirror`: what `Checkpointer(mirror=...)` runs on rank 0.

- After each commit, `enqueue(root, step)` hands the step to one background uploader thread.
  While an upload runs, only the newest waiting step is kept (a newer commit replaces an older
  one that has not started): the mirror follows the newest state with bounded work.
- `start(root)` makes the uploader finish what a killed or requeued run left: the newest local
  committed step that is newer than the newest complete one on the bucket.
- `pull_if_newer(root)`, before a restore: when the bucket holds a newer complete step than
  the local root (or the root is empty or lost), download it, verified, into the root.
- `pull_step(root, step)`, before `restore(step=N)`: when the local root lacks a complete
  step N and the bucket has it, download it, verified, into the root.
- `close()` waits for the uploader, at most `settings.close_deadline` seconds; a step it leaves
  off the bucket is a `mirror_behind` event, and the next run's `start` uploads it. An
  emergency exit does not wait: its upload is finished by the next run's `start`.
- A failed upload is tried again (`settings.attempts`, pauses doubling) unless a newer commit
  replaced it; every request and part is bounded by the settings' timeouts (storage/settings.py).
- What this run's own failed attempts left on the bucket (an unfinished multipart upload after
  the server died mid-upload, the objects of the attempt's folder) is removed as soon as the
  bucket answers again: after the next job that succeeds, and in `close()` (own.py). Strangers'
  leftovers wait for the age rule (leftovers.py).
Upload errors never reach the training thread: they are logged and recorded as events.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint.layout import step_dir_name
from ..errors import CheckpointError, NoCheckpointError
from ..events import (
    EV_MIRROR_BEHIND,
    EV_MIRROR_CONFLICT,
    EV_MIRROR_DOWNLOADED,
    EV_MIRROR_FAILED,
    EV_MIRROR_UPLOADED,
)
from ..storage import BucketRoot, DirRoot
from ..storage.s3 import S3Location, client, parse_s3_url
from ..storage.settings import MirrorSettings
from .own import OwnAttempts
from .transfer import Transfer, download_step, upload_step

log = logging.getLogger("slurmresume")

Event = Callable[..., Any]


class Mirror:
    """A background uploader to, and a verified downloader from, `s3://BUCKET/PREFIX`.
    One per process; only rank 0 uses it (the local root is shared by the ranks)."""

    def __init__(self, url: str | os.PathLike[str] | S3Location, *, retention: Any = None,
                 on_event: Event | None = None, chunk: int | None = None, concurrency: int | None = None,
                 settings: MirrorSettings | None = None) -> None:
        self.loc = url if isinstance(url, S3Location) else parse_s3_url(url)
        self.settings = settings or MirrorSettings.from_env()
        self.s3 = client(self.settings)
        self.retention = retention
        self.chunk, self.concurrency = chunk, concurrency
        self._on_event = on_event
        self.on_pull: Callable[[int], None] | None = None  # told a pull's bytes before it starts (the hang watch)
        self._cv = threading.Condition()
        self._pending: tuple[str, Path, int] | None = None  # ("upload", root, step) | ("scan", root, -1)
        self._busy = False
        self._current: int | None = None
        self._thread: threading.Thread | None = None
        self.done: list[Transfer] = []
        self.errors: list[str] = []
        self.unrestorable: dict[int, str] = {}  # bucket step -> why the last pull could not restore it
        self.behind: tuple[int | None, str] | None = None  # (step, why) when close() left a step off the bucket
        self._failed: tuple[int | None, str] | None = None  # the last job's failure, until a job succeeds
        self._refetched: set[int] = set()
        self.own = OwnAttempts()  # this run's upload attempts: the abandoned ones are removed here

    def __repr__(self) -> str:
        return f"Mirror({self.loc.url!r})"

    @property
    def bucket(self) -> BucketRoot:
        """The bucket as a storage root, through this mirror's client and settings."""
        return BucketRoot(self.loc, s3=self.s3, settings=self.settings)

    # -- uploads (background) ---------------------------------------------------------------

    def enqueue(self, root: Path, step: int) -> None:
        self._submit(("upload", Path(root), step))

    def start(self, root: Path) -> None:
        """Upload the newest local committed step if the bucket lacks it (resumes after a requeue)."""
        self._submit(("scan", Path(root), -1))

    def _submit(self, job: tuple[str, Path, int]) -> None:
        with self._cv:
            self._pending = job
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="slurmresume-mirror", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def busy(self) -> bool:
        with self._cv:
            return self._busy or self._pending is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until no upload is running or waiting; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._busy or self._pending is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> bool:
        """Wait for the uploader, at most `settings.close_deadline` seconds. True when the last
        upload reached the bucket; else one warning, a `mirror_behind` event (the next run's
        `start` finishes the upload) and False (`behind` says which step and why)."""
        started = time.monotonic()
        finished = self.wait(self.settings.close_deadline)
        if finished:  # at the latest now, within what is left of the deadline
            self._clean_own_within(self.settings.close_deadline - (time.monotonic() - started))
        if self.own.pending():
            log.warning("mirror: %d upload attempt(s) of this run stay unfinished on %s (the bucket did not "
                        "answer in time): removed by the next upload to it 6 h after they began",
                        len(self.own.pending()), self.loc.url)
        if finished and self._failed is None:
            return True
        if finished:
            assert self._failed is not None
            self.behind = self._failed
        else:
            with self._cv:
                step = self._pending[2] if self._pending is not None else self._current
            self.behind = (step if step is not None and step >= 0 else None,
                           f"still uploading after the {self.settings.close_deadline:g} s close deadline")
        step, why = self.behind
        log.warning("mirror: step %s is not on %s at close (%s): the next run with this mirror uploads it",
                    step if step is not None else "(newest)", self.loc.url, why)
        self._event(EV_MIRROR_BEHIND, step=step, url=self.loc.url, error=why[:500])
        return False

    def _run(self) -> None:
        tries = 0
        while True:
            with self._cv:
                if self._pending is None:
                    self._busy = False
                    self._cv.notify_all()
                    return
                job, self._pending, self._busy = self._pending, None, True
                self._current = job[2]
            try:
                self._do(*job)
                tries, self._failed = 0, None
                self._clean_own()  # the bucket answers (again): what this run abandoned goes now
            except Exception as exc:  # never into training: recorded, retried below or by the next commit/run
                tries += 1
                self.errors.append(str(exc))
                self._failed = (job[2] if job[2] >= 0 else None, str(exc))
                log.warning("mirror: %s to %s failed (try %d of %d): %s", job[0], self.loc.url, tries,
                            self.settings.attempts, exc)
                self._event(EV_MIRROR_FAILED, step=job[2] if job[2] >= 0 else None, error=str(exc)[:500])
                self._retry_later(job, tries)

    def _retry_later(self, job: tuple[str, Path, int], tries: int) -> None:
        """Put a failed job back after a pause, unless a newer one is waiting or the tries are spent."""
        with self._cv:
            if self._pending is not None or tries >= self.settings.attempts:
                return
            self._cv.wait(self.settings.pause(tries))  # a new commit (notify) ends the pause early
            if self._pending is None:
                self._pending = job

    def _do(self, kind: str, root: Path, step: int) -> None:
        if kind == "scan":
            local = DirRoot(root).latest()
            if local is None:
                return
            newest = self.bucket.latest()
            if newest is not None and newest.step >= local.step:
                return
            step = local.step
            log.info("mirror: resuming the upload of step %d (the bucket's newest complete is %s)", step,
                     newest.step if newest else "none")
        result = upload_step(self.s3, self.loc, root / step_dir_name(step), step, chunk=self.chunk,
                             concurrency=self.concurrency, settings=self.settings, own=self.own)
        self.done.append(result)
        if result.action == "uploaded":
            log.info("mirror: step %d uploaded to %s (%.1f MB in %.2f s)", step, self.loc.step_url(step),
                     result.bytes / 1e6, result.seconds)
            self._event(EV_MIRROR_UPLOADED, step=step, url=self.loc.step_url(step), bytes=result.bytes,
                        seconds=round(result.seconds, 4))
        elif result.action == "conflict":
            self._event(EV_MIRROR_CONFLICT, step=step, error=result.detail)
        if result.action == "uploaded":
            self._remove_abandoned()
        if self.retention is not None and result.action == "uploaded":
            pruned = self.bucket.prune(self.retention)
            for name in pruned.deleted:
                log.info("mirror retention: deleted %s/%s", self.loc.url, name)

    def _clean_own_within(self, seconds: float) -> None:
        """`_clean_own` on a daemon thread, waited for at most `seconds` (close()'s deadline holds
        even when the bucket stopped answering; what is not removed by then stays noted)."""
        if not self.own.pending() or seconds <= 0:
            return
        cleaner = threading.Thread(target=self._clean_own, name="slurmresume-mirror-clean", daemon=True)
        cleaner.start()
        cleaner.join(seconds)

    def _clean_own(self) -> None:
        """Remove what this run's abandoned upload attempts left (own.py), when there is any."""
        if not self.own.pending():
            return
        try:
            removed = self.own.clean(self.s3, self.loc)
        except Exception as exc:  # garbage never fails an upload nor the run: kept for the next try
            log.warning("mirror: the abandoned upload attempt(s) of this run on %s not removed yet: %s",
                        self.loc.url, exc)
            return
        log.info("mirror: removed %d unfinished upload(s)/object(s) this run left on %s", removed, self.loc.url)

    def _remove_abandoned(self) -> None:
        from .leftovers import remove_abandoned

        try:
            removed = remove_abandoned(self.s3, self.loc, time.time())
        except CheckpointError as exc:  # garbage never fails an upload
            log.warning("mirror: abandoned uploads on %s not removed: %s", self.loc.url, exc)
            return
        if removed:
            log.info("mirror: removed %d abandoned upload(s)/object(s) on %s", removed, self.loc.url)

    def _event(self, name: str, **fields: Any) -> None:
        if self._on_event is not None:
            self._on_event(name, **fields)

    # -- restore (synchronous) --------------------------------------------------------------

    def pull_if_newer(self, root: Path) -> Transfer | None:
        """Download the newest complete bucket step newer than the local root's newest complete
        one (falling back to older bucket steps that are still newer when one fails its
        checksums). None when the local root is as new. Raises CheckpointError only when the
        bucket cannot be read and the local root has nothing: starting fresh then would
        silently throw away the mirrored run."""
        from .leftovers import remove_partial_downloads

        root = Path(root)
        for name in remove_partial_downloads(root):
            log.info("mirror: removed %s/%s, left by a killed download", root, name)
        local = DirRoot(root).latest() if root.is_dir() else None
        have = local.step if local is not None else -1
        try:
            steps = self.bucket.listing()
        except CheckpointError as exc:
            if local is None:
                raise CheckpointError(f"the local root {root} holds no checkpoint and the mirror {self.loc.url} "
                                      f"cannot be read ({exc}): fix the mirror's endpoint/credentials "
                                      "(AWS_ENDPOINT_URL, AWS_PROFILE) or drop --mirror to start fresh") from exc
            log.warning("mirror %s unreadable (%s): restoring from the local root", self.loc.url, exc)
            return None
        self.unrestorable = {}
        deadline = time.monotonic() + self.settings.pull_deadline
        for rs in steps:
            if rs.step <= have or not rs.has_marker:
                continue
            if time.monotonic() > deadline:
                self.unrestorable[rs.step] = f"not tried: the {self.settings.pull_deadline:g} s pull deadline passed"
                continue
            info = self.bucket.inspect(rs.step, listed=rs)
            if not info.complete:
                self.unrestorable[rs.step] = info.problem or "incomplete"
                continue
            self._pulling(info.manifest)
            try:
                result = download_step(self.s3, self.loc, rs.step, root, settings=self.settings, deadline=deadline)
            except CheckpointError as exc:
                log.warning("mirror: step %d on %s not restored: %s", rs.step, self.loc.url, exc)
                self.unrestorable[rs.step] = str(exc)
                continue
            newest = info
            log.info("mirror: step %d downloaded from %s (local newest was %s)", newest.step, self.loc.url,
                     have if have >= 0 else "none")
            self._event(EV_MIRROR_DOWNLOADED, step=newest.step, url=self.loc.step_url(newest.step),
                        bytes=result.bytes, seconds=round(result.seconds, 4))
            return result
        return None

    def _pulling(self, manifest: Any) -> None:
        if self.on_pull is not None and manifest is not None:
            self.on_pull(int(manifest.total_bytes))

    def fresh_start_refusal(self, root: Path) -> str | None:
        """Rank 0, when nothing loads and the local root holds no committed step: the bucket's
        committed steps that the last `pull` could not restore, as one refusal line (None when
        the bucket holds no committed step, so a fresh start throws nothing away)."""
        if not self.unrestorable:
            return None
        bad = "; ".join(f"{step_dir_name(s)}: {why}" for s, why in sorted(self.unrestorable.items(), reverse=True))
        return (f"refusing a fresh start: {root} holds no checkpoint and the mirror {self.loc.url} holds "
                f"{len(self.unrestorable)} committed step(s), none restorable ({bad}); run `slurmresume verify "
                f"--all {self.loc.url}`, or pass restore(..., allow_fresh_start=True) (or set "
                "SLURMRESUME_ALLOW_FRESH_START=1) to start from step 0")

    def refetch(self, root: Path, failed: set[int]) -> int | None:
        """Rank 0, after the newest local steps failed to load: fetch the newest failed step whose
        local copy fails its checksums again from the bucket when the bucket holds the same
        commit (identical marker) intact; the damaged local copy is replaced. The step fetched,
        or None (each step once)."""
        from .transfer import read_local_marker

        for step in sorted(failed - self._refetched, reverse=True):
            self._refetched.add(step)
            if DirRoot(root).inspect(step, verify=True).complete:
                continue  # the local bytes are sound: what failed was not them (e.g. the state's keys)
            local_marker = read_local_marker(root / step_dir_name(step))
            try:
                result = download_step(self.s3, self.loc, step, root, replace_if_marker=local_marker,
                                       settings=self.settings,
                                       deadline=time.monotonic() + self.settings.pull_deadline)
            except CheckpointError as exc:
                log.warning("mirror: step %d not fetched again from %s: %s", step, self.loc.url, exc)
                continue
            if result.action == "downloaded":
                log.warning("mirror: the local copy of step %d failed to load; replaced by the bucket's "
                            "verified copy of the same commit", step)
                self._event(EV_MIRROR_DOWNLOADED, step=step, url=self.loc.step_url(step), bytes=result.bytes,
                            seconds=round(result.seconds, 4), replaced=True)
                return step
        return None

    def pull(self, root: Path, step: int | None) -> Transfer | None:
        """What `Checkpointer.restore(step=...)` calls on rank 0 before choosing a step."""
        return self.pull_if_newer(root) if step is None else self.pull_step(root, step)

    def pull_step(self, root: Path, step: int) -> Transfer | None:
        """Download step `step` when the local root has no complete copy of it (missing, or a
        leftover without a valid commit, which the download replaces). None when the local copy
        is complete, or when the bucket lacks it too and a local copy exists (the restore then
        reports what is wrong with it). NoCheckpointError when neither tier has it; CorruptCheckpointError
        when the bucket's copy fails its checksums (nothing is left behind then)."""
        root = Path(root)
        if DirRoot(root).inspect(step).complete:
            return None
        bucket = self.bucket
        found = next((rs for rs in bucket.listing() if rs.step == step), None)
        info = bucket.inspect(step, listed=found) if found is not None else None
        if info is None or not info.complete:
            if (root / step_dir_name(step)).exists():
                return None  # the local check names what is wrong with the local copy
            why = "absent" if info is None else info.problem
            raise NoCheckpointError(f"step {step} is not a complete checkpoint under {root} nor on the mirror "
                                    f"{self.loc.url} ({why}): `slurmresume status --ckpt-dir {self.loc.url}` "
                                    "lists the mirror's steps")
        self._pulling(info.manifest)
        result = download_step(self.s3, self.loc, step, root, settings=self.settings,
                               deadline=time.monotonic() + self.settings.pull_deadline)
        log.info("mirror: step %d downloaded from %s for restore(step=%d)", step, self.loc.url, step)
        self._event(EV_MIRROR_DOWNLOADED, step=step, url=self.loc.step_url(step), bytes=result.bytes,
                    seconds=round(result.seconds, 4))
        return result

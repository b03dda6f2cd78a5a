"""The upload attempts this process gave up on: its own to remove, as soon as the bucket answers.

A bucket cannot say whether another writer is alive, so what strangers leave waits for the age
rule (leftovers.py: six hours). A writer knows its own attempts, though: `upload_step` notes
each attempt folder before its first request (`started`) and says how it ended. One whose
marker won is done; one that failed (the server died mid-upload, a request ran out of tries)
or lost the marker race is *abandoned*: no request of it is in flight any more (`upload_files`
waits for them before it raises) and this process never writes its marker, so its unfinished
multipart uploads and its objects can only ever be garbage. `clean` removes them: the
multipart uploads under the attempt's folder (also one whose creation the server took but
never answered), then its objects, but never the objects a marker names (a marker write that
failed on the way back may have been stored: the marker is read first).

`Mirror` cleans after each job that succeeded (the bucket answers again) and in `close()`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..checkpoint.layout import MARKER
from ..storage.bucketcommit import folder_of
from ..storage.s3 import S3Location, abort_uploads, call, head, list_objects


@dataclass(frozen=True)
class Attempt:
    step: int
    folder: str  # "attempt-<token>" (commit.new_attempt)


class OwnAttempts:
    """The attempts one process started, by state. Thread-safe; one per `Mirror`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[Attempt] = set()
        self._abandoned: set[Attempt] = set()

    def started(self, step: int, folder: str) -> None:
        with self._lock:
            self._running.add(Attempt(step, folder))

    def committed(self, step: int, folder: str) -> None:
        with self._lock:
            self._running.discard(Attempt(step, folder))

    def abandoned(self, step: int, folder: str) -> None:
        with self._lock:
            self._running.discard(Attempt(step, folder))
            self._abandoned.add(Attempt(step, folder))

    def pending(self) -> list[Attempt]:
        """The abandoned attempts not removed yet, oldest step first."""
        with self._lock:
            return sorted(self._abandoned, key=lambda a: (a.step, a.folder))

    def clean(self, s3: Any, loc: S3Location) -> int:
        """Remove every abandoned attempt's uploads and objects (see the module docstring).
        Returns how many uploads and objects were removed; raises CheckpointError at the first
        request that fails (the attempts not removed yet stay noted for the next call)."""
        removed = 0
        for attempt in self.pending():
            removed += remove_attempt(s3, loc, attempt)
            with self._lock:
                self._abandoned.discard(attempt)
        return removed


def remove_attempt(s3: Any, loc: S3Location, attempt: Attempt) -> int:
    """Abort the multipart uploads and delete the objects under `attempt`'s folder, unless the
    step's marker names that folder (then it is a commit: nothing is touched)."""
    stored = head(s3, loc, loc.key(attempt.step, MARKER))
    if stored is not None and folder_of(dict(stored.get("Metadata") or {}), loc.step_url(attempt.step)) \
            == attempt.folder:
        return 0
    prefix = loc.key(attempt.step, f"{attempt.folder}/")
    removed = abort_uploads(s3, loc, prefix)
    keys = [o["Key"] for page in list_objects(s3, loc, prefix) for o in page.get("Contents") or []]
    for i in range(0, len(keys), 1000):
        call(f"deleting the abandoned attempt s3://{loc.bucket}/{prefix}", s3.delete_objects, Bucket=loc.bucket,
             Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]], "Quiet": True})
    return removed + len(keys)

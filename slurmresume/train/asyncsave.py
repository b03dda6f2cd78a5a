"""The background writer of `Checkpointer.save_async`: at most one save in flight.

The training thread snapshots the tensors into reused buffers (`snapshot.SnapshotPool`: pinned,
on a side stream, for CUDA) and returns; a daemon thread waits for the copy, then runs the whole
collective save sequence (`saving.save_collective`, on the side group, so it never pairs with the
training thread's collectives). An error is kept, never raised on the writer thread, and raised
on the training thread by the next `wait()` (the next `step()`, `save()` or `close()`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from ..beatfile import SAVE
from ..contract import EXIT_SAVE_FAILED
from .emergency import exit_now
from .heartbeat import Beat, phase
from .snapshot import SnapshotPool

if TYPE_CHECKING:
    from .savepolicy import SaveScheduler
    from .saving import Payload

log = logging.getLogger("slurmresume")


class AsyncWriter:
    """One `Checkpointer`'s writer. Its methods run on the training thread; `write` runs on the
    writer thread. `beat`: the heartbeat the snapshot is reported on (SAVE); `sched`: told when
    a save has begun, so that no step is due again while it is written."""

    def __init__(self, beat: Beat | None, sched: SaveScheduler) -> None:
        self.beat = beat
        self.sched = sched
        self.pool = SnapshotPool()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.last_blocking_s = 0.0  # what training paid for the last snapshot (the memory tier's cost)

    def in_flight(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def save(self, step: int, overlap: str, prepare: Callable[[], Payload],
             write: Callable[[Payload, float, float], object], *, file_tier: bool = True) -> bool:
        """Every rank, `Checkpointer.save_async`: wait for the save in flight (with
        overlap="skip", return False instead), take this rank's payload (`prepare`) and snapshot
        its tensors, then run `write(snapshot, started, blocking_s)`, the collective save, on the
        writer thread once the copy is done. Returns True: the save of `step` has begun.
        `file_tier=False`: a memory-tier snapshot (train/memtier.py), of which the file tier's
        save schedule is not told."""
        if self.in_flight() and overlap == "skip":
            log.info("step %d: previous async save still in flight, skipping this one", step)
            return False
        # waiting for the previous write and taking the snapshot are save time, not step time
        with phase(self.beat, SAVE):
            self.wait()
            started = time.perf_counter()
            payload = prepare()
            copies, ready = self.pool.snapshot(payload.tensors)
        blocking_s = self.last_blocking_s = time.perf_counter() - started  # what training paid (Young/Daly's C)
        # The step is taken care of from now on: the policy must not call it (or the next steps,
        # by the clock) due again while the write runs, or each timed save is written twice and
        # the second one waits for the first.
        if file_tier:
            self.sched.started(step)
        snapshot = replace(payload, tensors=copies)

        def run() -> None:
            ready()
            write(snapshot, started, blocking_s)

        self.start(step, run)
        return True

    def start(self, step: int, write: Callable[[], None]) -> None:
        """Run `write` (the collective save of `step`) on the writer thread. The caller waited first."""

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # raised on the training thread by wait()
                self.error = exc

        self.thread = threading.Thread(target=run, name=f"slurmresume-save-{step}", daemon=True)
        self.thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) has committed; re-raise its error here."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            exc, self.error = self.error, None
            raise exc

    def failed(self) -> bool:
        """The last save ended with an error nobody has seen yet (and nothing is in flight)."""
        return self.error is not None and not self.in_flight()

    def finish(self) -> BaseException | None:
        """At exit: let the save in flight finish (its daemon thread would be frozen mid-write),
        then hand back its error, if any, without raising."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        exc, self.error = self.error, None
        return exc

    def finish_at_exit(self, on_save_error: str) -> None:
        """atexit, when the script ended without `close()`: the save in flight is finished here
        (`finish`); if it failed and on_save_error is "raise", the process exits with
        EXIT_SAVE_FAILED and one line on stderr instead of 0, else the error is logged. Local
        only: the writer's collectives pair up with the other ranks' writers, which finish the
        same way."""
        if self.in_flight():
            log.warning("the script ended while an async save was in flight (no ckpt.close()): finishing it")
        exc = self.finish()
        if exc is not None and on_save_error == "raise":
            print(f"slurmresume: the last async save failed and the script ended without ckpt.close(): {exc}",
                  file=sys.stderr, flush=True)
            exit_now(EXIT_SAVE_FAILED)
        if exc is not None:
            log.warning("the last async save failed: %s", exc)

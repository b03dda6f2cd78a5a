"""The background writer of `Checkpointer.save_async`: at most one save in flight.

The training thread snapshots the tensors into reused buffers (`snapshot.SnapshotPool`: pinned,
on a side stream, for CUDA) and returns; a daemon thread waits for the copy, then runs the whole
collective save sequence (`saving.save_collective`, on the side group, so it never pairs with the
training thread's collectives). An error is kept, never raised on the writer thread, and raised
on the training thread by the next `wait()` (the next `step()`, `save()` or `close()`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from .snapshot import SnapshotPool


class AsyncWriter:
    def __init__(self) -> None:
        self.pool = SnapshotPool()
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def in_flight(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def snapshot(self, tensors: list[Any]) -> tuple[list[Any], Callable[[], None]]:
        """Copies of `tensors` in the pool's buffers and the wait for the copy (a no-op on CPU)."""
        return self.pool.snapshot(tensors)

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

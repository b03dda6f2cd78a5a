"""The shard writer's hasher thread (`writer.ShardSink`): the stream's xxh3 and the per-block
digests, computed beside the writes over the same memory. xxhash releases the GIL for large
buffers, so the caller copying or queueing, the writer writing and this thread hashing run at
once; the stream hash is one sequential xxh3, so one thread per shard.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import xxhash

QUEUED = 16  # items (views of the caller's memory, or 4 MiB copies) waiting for a writer or hasher thread


class Hasher:
    """One thread that hashes, in order, what the sink queues: every item updates the stream's
    xxh3, and an item with a `digests` list also appends its own xxh3 (a block digest) to it.
    Items are memory that stays unchanged until `close()`: the caller's tensors (feed()'s
    contract) or a private copy. At most QUEUED items wait, so copies stay bounded."""

    def __init__(self) -> None:
        self.hasher = xxhash.xxh3_64()
        self.q: queue.Queue[Any] = queue.Queue(maxsize=QUEUED)
        self.seconds = 0.0  # thread-seconds hashing
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="slurmresume-shard-hasher", daemon=True)
        self.thread.start()

    def put(self, view: memoryview | bytes, digests: list[str] | None = None) -> None:
        self.q.put((view, digests))

    def close(self) -> str:
        """Wait for everything queued; the stream's hex digest."""
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join()
        if self.error is not None:
            raise self.error
        return self.hasher.hexdigest()

    def _run(self) -> None:
        while (item := self.q.get()) is not None:
            view, digests = item
            try:
                if self.error is None:
                    t = time.perf_counter()
                    self.hasher.update(view)
                    if digests is not None:
                        digests.append(xxhash.xxh3_64_hexdigest(view))
                    self.seconds += time.perf_counter() - t
            except BaseException as exc:  # raised on the caller's thread by close()
                self.error = exc

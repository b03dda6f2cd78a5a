"""How a shard's bytes reach the disk: large aligned O_DIRECT writes from a reused staging buffer,
double-buffered so that copying + hashing one chunk overlaps writing the previous one.

Measured on these machines (perf-facts.md, scripts/bench.py): page-cache writeback is the
bottleneck for buffered writes + fsync (0.2-1.2 GB/s), while O_DIRECT with 32-64 MiB aligned
buffers reaches 1.4-2 GB/s. The staging buffers (2 x CHUNK) are allocated once per thread and
reused, so a save's extra memory is about the largest tensor that needs a contiguous copy plus
2 x CHUNK. Where O_DIRECT is refused (some file systems), the writer falls back to plain writes
straight from tensor memory.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from typing import Any

import numpy as np
import xxhash

from . import fsio

CHUNK = 32 << 20
ALIGN = 4096
_local = threading.local()


def _staging() -> tuple[np.ndarray, np.ndarray]:
    bufs = getattr(_local, "bufs", None)
    if bufs is None:
        # mmap'ed memory is page-aligned, as O_DIRECT requires; touching it once up front
        # avoids first-touch page faults during the first save.
        bufs = tuple(np.frombuffer(mmap.mmap(-1, CHUNK), dtype=np.uint8) for _ in range(2))
        for b in bufs:
            b[::4096] = 0
        _local.bufs = bufs
    return bufs


class ShardSink:
    """Writes a byte stream to `fd` durably; `feed()` chunks, `finish()` fsyncs. Hashes with xxh3."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = path
        self.hasher = xxhash.xxh3_64()
        self.total = 0
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
        self.direct = hasattr(os, "O_DIRECT") and os.environ.get("SLURMRESUME_NO_ODIRECT") != "1"
        fd = -1
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                self.direct = False
        self.fd = fd if fd >= 0 else os.open(path, flags, 0o644)
        if self.direct:
            self.bufs = _staging()
            self.cur, self.fill = 0, 0
            self.q: queue.Queue[tuple[int, int] | None] = queue.Queue(maxsize=1)
            self.free = [threading.Semaphore(1), threading.Semaphore(1)]
            self.error: BaseException | None = None
            self.thread = threading.Thread(target=self._writer, name="slurmresume-shard-writer", daemon=True)
            self.thread.start()

    # -- producer side (caller's thread) ---------------------------------------------------

    def feed(self, data: memoryview | bytes) -> None:
        view = memoryview(data).cast("B")
        self.total += len(view)
        if not self.direct:
            self.hasher.update(view)
            for start in range(0, len(view), CHUNK):
                fsio.write_all(self.fd, view[start : start + CHUNK], "shard.data", self.path)
            return
        src = np.frombuffer(view, dtype=np.uint8) if len(view) else np.empty(0, np.uint8)
        pos = 0
        while pos < len(src):
            if self.fill == 0:
                self.free[self.cur].acquire()  # wait until the writer is done with this buffer
                self._raise_if_failed()
            n = min(CHUNK - self.fill, len(src) - pos)
            np.copyto(self.bufs[self.cur][self.fill : self.fill + n], src[pos : pos + n])
            self.fill += n
            pos += n
            if self.fill == CHUNK:
                self._flush_buffer()

    def _flush_buffer(self) -> None:
        filled = self.fill
        self.hasher.update(self.bufs[self.cur][:filled].data)
        self.q.put((self.cur, filled))
        self.cur, self.fill = 1 - self.cur, 0

    def finish(self) -> str:
        """Write what is left, fsync, close. Returns the xxh3 hex digest of all bytes fed."""
        try:
            if self.direct:
                if self.fill:
                    self._flush_buffer()
                self.q.put(None)
                self.thread.join()
                self._raise_if_failed()
                os.ftruncate(self.fd, self.total)  # drop the alignment padding of the last block
            fsio.fsync_fd(self.fd, "shard", self.path)
        finally:
            fd, self.fd = self.fd, -1  # abort() after a failed finish() must not close it again:
            os.close(fd)  # by then the number may belong to a file another thread opened
        return self.hasher.hexdigest()

    def abort(self) -> None:
        if self.direct and self.thread.is_alive():
            self.q.put(None)
            self.thread.join()
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass

    def _raise_if_failed(self) -> None:
        if self.direct and self.error is not None:
            raise self.error

    # -- writer thread ---------------------------------------------------------------------

    def _writer(self) -> None:
        while (item := self.q.get()) is not None:
            idx, filled = item
            try:
                if self.error is None:
                    padded = -(-filled // ALIGN) * ALIGN
                    if padded != filled:
                        self.bufs[idx][filled:padded] = 0
                    fsio.write_all(self.fd, self.bufs[idx][:padded].data, "shard.data", self.path)
            except BaseException as exc:  # handed to the producer, raised on its thread
                self.error = exc
            finally:
                self.free[idx].release()


def tensor_bytes(t: Any) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    import torch

    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")

"""How a shard's bytes reach the disk: one of several write paths, chosen per file system by
measurement (`calibrate.open_sink`), each ending in an fsync before the caller renames the file.

No single path wins on these machines from hour to hour (perf-facts.md, "the disk changes which
path wins"): O_DIRECT with large aligned buffers was 2-4x ahead of buffered writes one day and
behind them the next. So the writer offers:

  direct       O_DIRECT from 2 reused 32 MiB staging buffers: copying + hashing one chunk
               overlaps writing the previous one (one write in flight)
  direct-par   O_DIRECT from 4 reused 16 MiB buffers written by 4 threads with pwrite (up to
               four writes in flight, for devices that need queue depth); same 64 MiB of staging
  buffered-wb  plain writes straight from tensor memory, with early writeback: each written
               32 MiB range is handed to the kernel at once (sync_file_range WRITE) and the
               range before it waited for, so the final fsync finds little left dirty
  buffered     plain writes from tensor memory, then fsync (what most peers do)
  buffered-par plain writes from tensor memory by PAR_THREADS threads, each taking the next queued
               range and writing it with pwritev at its own offset of the one shard file, then
               fsync. On a VM whose host backs freshly allocated guest memory lazily, filling the
               page cache is a host fault per page, and one writer thread is then bound by its own
               faults: two fill it at once (issue #51: what DCP's two writer threads win, with
               two files; the shard stays one safetensors file, byte for byte the same)
Hashing (xxh3 of the stream, and the per-block digests) runs on its own thread
(`hashing.Hasher`) over the same memory the writer writes: xxhash releases the GIL for large buffers, so the caller only
queues, the writer writes and the hasher hashes at once. The stream hash is one sequential
xxh3, so one hasher thread per shard (~20 GB/s here), not several.

Every path writes the same bytes, hashes them with xxh3 in order; `drain()` waits for the writes
and the hashes, `sync()` fsyncs (`finish()` is both): a caller may write another file (the
shard's index) between the two while the fsync runs on another thread.
Staging buffers are allocated once per thread and reused. Where O_DIRECT is refused (some file
systems), a direct path falls back to `buffered`.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import fsio, writeback
from .hashing import QUEUED, Hasher

CHUNK = 32 << 20
ALIGN = 4096
STRATEGIES = ("direct", "direct-par", "buffered-wb", "buffered", "buffered-par")
# strategy -> (staging buffers, bytes each, writer threads); buffered paths stage nothing
_DIRECT = {"direct": (2, CHUNK, 1), "direct-par": (4, CHUNK // 2, 4)}
PIECE = 4 << 20  # hashed right after it is copied or queued, while it is still in the CPU's cache
BATCH = 64  # buffered paths: the most queued views one writev hands the kernel
PAR_THREADS = 2  # buffered-par: writer threads on one file (2: as many as DCP's measured best, and the cores here)
_local = threading.local()

_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = (
    writeback.WAIT_BEFORE, writeback.WRITE, writeback.WAIT_AFTER)
_sync_file_range = writeback.sync_file_range  # a module name, so tests can refuse it here


def _staging(count: int, size: int) -> tuple[np.ndarray, ...]:
    pools: dict[tuple[int, int], tuple[np.ndarray, ...]] = getattr(_local, "pools", None) or {}
    bufs = pools.get((count, size))
    if bufs is None:
        # mmap'ed memory is page-aligned, as O_DIRECT requires; touching it once up front
        # avoids first-touch page faults during the first save. PRIVATE: Python's anonymous
        # mmap is MAP_SHARED by default, so ranks forked after a save in their parent (fork-started
        # workers, tests) wrote through one physical buffer and corrupted each other's shards.
        bufs = tuple(np.frombuffer(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS),
                                   dtype=np.uint8) for _ in range(count))
        for b in bufs:
            b[::4096] = 0
        pools[(count, size)] = bufs
        _local.pools = pools
    return bufs


def release_staging(keep: str | None = None) -> None:
    """Drop this thread's staging buffers except those of `keep` (after a calibration)."""
    pools = getattr(_local, "pools", None) or {}
    wanted = _DIRECT.get(keep or "")
    _local.pools = {k: v for k, v in pools.items() if wanted is not None and k == wanted[:2]}


class ShardSink:
    """Writes a byte stream durably: `feed()` chunks, `finish()` (`drain`, `sync`, `report`)
    fsyncs and returns the xxh3 digest. `strategy` is one of STRATEGIES; `calibrate.open_sink`
    picks it for a file system (this module never imports calibrate, which imports it to
    measure). `on_finish(strategy, bytes, seconds)` is called after a successful finish
    (calibrate's re-check)."""

    def __init__(self, path: str | os.PathLike[str], strategy: str, *, source: str = "given",
                 on_finish: Callable[[str, int, float], None] | None = None, base: int = 0,
                 shared: bool = False, sync: bool = True) -> None:
        # `shared`: write the range starting at `base` (a multiple of ALIGN) of an existing file,
        # sized by its creator (a node file, `nodefile`): no create, no truncate; `sync=False`
        # leaves the fsync to that file's owner.
        self.path = path
        self.base, self.shared, self.durable = base, shared, sync
        self.digest = ""
        self.total = 0
        self.source = source
        self.on_finish = on_finish
        if strategy not in STRATEGIES:
            raise ValueError(f"unknown write strategy {strategy!r}; valid: {', '.join(STRATEGIES)}")
        flags = os.O_WRONLY | os.O_NOFOLLOW | (0 if shared else os.O_CREAT | os.O_TRUNC)
        fd = -1
        if strategy in _DIRECT and hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError:
                strategy = "buffered"
        elif strategy in _DIRECT:
            strategy = "buffered"
        self.strategy = strategy
        self.direct = strategy in _DIRECT
        self.fd = fd if fd >= 0 else os.open(path, flags, 0o644)
        if base:
            os.lseek(self.fd, base, os.SEEK_SET)  # the buffered paths write at the file position
        self.queued_at = base  # buffered-par: the file offset of the next byte queued
        self.started = time.perf_counter()
        self.seconds = 0.0
        self.kicked = self.waited = 0  # buffered-wb: bytes handed to writeback / known written
        # where the time went (`timing()`, the save's breakdown): seconds in the write calls
        # (summed over writer threads), hashing, the final fsync, the producer waiting for room
        self.write_s = self.hash_wait_s = self.fsync_s = self.wait_s = 0.0
        self.error: BaseException | None = None
        if self.direct:
            count, self.size, threads = _DIRECT[strategy]
            self.bufs = _staging(count, self.size)
            self.cur, self.fill, self.offset = 0, 0, base
            self.q: queue.Queue[Any] = queue.Queue(maxsize=count)
            self.free = [threading.Semaphore(1) for _ in range(count)]
            target = self._writer
        elif strategy == "buffered-par":
            self.q = queue.Queue(maxsize=QUEUED)
            target, threads = self._parallel_writer, PAR_THREADS
        else:
            self.q = queue.Queue(maxsize=QUEUED)
            target, threads = self._buffered_writer, 1
        self._sum = threading.Lock()  # writer threads add their write seconds under it
        self.threads = [threading.Thread(target=target, name="slurmresume-shard-writer", daemon=True)
                        for _ in range(threads)]
        for t in self.threads:
            t.start()
        self.hashing = Hasher()  # started last: a failed open above leaves no thread behind

    # -- producer side (caller's thread) ---------------------------------------------------

    def feed(self, data: memoryview | bytes, *, reused: bool = False, digests: list[str] | None = None) -> None:
        """Queue `data` for writing and hashing. The buffered paths write from the caller's memory
        in a thread after feed() returns (no copy), and the hasher reads it on its own thread, so
        that memory must stay unchanged until finish(): a tensor being saved does. A caller that
        refills one buffer (a read loop) passes `reused=True`: the buffered paths then queue a copy
        (to the writer and the hasher alike), the direct paths hash a copy of what they staged.
        The direct paths always copy into staging (O_DIRECT needs aligned memory). With
        `digests` (not with `reused`), the xxh3 of all of `data` is appended to that list by the
        hasher (a block digest: complete after drain())."""
        if reused and digests is not None:
            raise ValueError("block digests need memory that stays unchanged: not with reused=True")
        view = memoryview(data).cast("B")
        self.total += len(view)
        if not self.direct:
            self._raise_if_failed()
            step = PIECE if reused else CHUNK
            for start in range(0, len(view), step):
                part = view[start : start + step]
                item = bytes(part) if reused else part
                t = time.perf_counter()
                if self.strategy == "buffered-par":  # each range carries its offset: any thread writes it
                    self.q.put((item, self.queued_at))
                    self.queued_at += len(item)
                else:
                    self.q.put(item)  # at most QUEUED items wait at once
                self.wait_s += time.perf_counter() - t
                if reused:
                    self._hash(item)
            if not reused:
                self._hash(view, digests)
            return
        src = np.frombuffer(view, dtype=np.uint8) if len(view) else np.empty(0, np.uint8)
        pos = 0
        while pos < len(src):
            if self.fill == 0:
                t = time.perf_counter()
                self.free[self.cur].acquire()  # wait until a writer is done with this buffer
                self.wait_s += time.perf_counter() - t
                self._raise_if_failed()
            n = min(self.size - self.fill, len(src) - pos, PIECE)
            np.copyto(self.bufs[self.cur][self.fill : self.fill + n], src[pos : pos + n])
            if digests is None:  # the piece just copied, hashed while it is in cache
                self._hash(bytes(view[pos : pos + n]) if reused else view[pos : pos + n])
            self.fill += n
            pos += n
            if self.fill == self.size:
                self._flush_buffer()
        if digests is not None:
            self._hash(view, digests)  # the source, unchanged until finish(): copied just now, in cache

    def feed_blocks(self, data: memoryview, block: int) -> list[str]:
        """`feed(data)` one `block` at a time; returns the list the hasher fills with each block's
        xxh3 hex digest (a shard's per-block checksums), complete once drain() returns."""
        view = memoryview(data).cast("B")
        digests: list[str] = []
        for i in range(0, len(view), block):
            self.feed(view[i : i + block], digests=digests)
        return digests

    def _hash(self, view: memoryview | bytes, digests: list[str] | None = None) -> None:
        """Hand `view` to the hasher thread in PIECE items (one item when it carries a block digest)."""
        step = len(view) if digests is not None else PIECE
        for at in range(0, len(view), max(step, 1)):
            t = time.perf_counter()
            self.hashing.put(view[at : at + step], digests)  # waits only when QUEUED items wait
            self.hash_wait_s += time.perf_counter() - t

    def _writeback(self, written: int) -> None:
        """Start writeback of each new CHUNK range, and wait for the one before it: the page cache
        holds at most ~2 chunks of this file dirty, and the fsync at the end has little left."""
        if written - self.kicked < CHUNK:
            return
        self._srf(self.kicked, written - self.kicked, _SYNC_FILE_RANGE_WRITE)
        if self.kicked > self.waited:
            self._srf(self.waited, self.kicked - self.waited,
                      _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)
            self.waited = self.kicked
        self.kicked = written

    def _srf(self, offset: int, nbytes: int, flags: int) -> None:
        if self.strategy != "buffered-wb" or _sync_file_range is None:
            return
        if _sync_file_range(self.fd, self.base + offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE):
                self.strategy = "buffered"  # not here: plain writes, the final fsync makes them durable
                return
            raise OSError(err, f"sync_file_range: {os.strerror(err)}", os.fspath(self.path))

    def _flush_buffer(self) -> None:
        filled = self.fill
        self.q.put((self.cur, filled, self.offset))
        self.offset += filled
        self.cur, self.fill = (self.cur + 1) % len(self.bufs), 0

    def drain(self) -> str:
        """Write and hash what is left (not yet durable: `sync()`). Returns the xxh3 hex digest of
        all bytes fed; every list feed_blocks returned is complete. On error, call abort()."""
        if self.direct and self.fill:
            self._flush_buffer()
        self._stop_writers()
        t = time.perf_counter()
        self.digest = self.hashing.close()
        self.hash_wait_s += time.perf_counter() - t
        self._raise_if_failed()
        if self.direct and not self.shared:
            os.ftruncate(self.fd, self.total)  # drop the alignment padding of the last block
        return self.digest

    def sync(self, *, crossed: bool = False) -> None:
        """fsync and close (after drain). Any thread may call it; `crossed` when the caller
        already crossed the fault point (`fsio.fault_point("fsync.shard")`) on its own thread,
        so that the labels keep their order whatever the threads do."""
        try:
            t = time.perf_counter()
            if not self.durable:
                pass  # a range of a node file: its creator fsyncs the whole file (nodefile)
            else:  # through the seam either way (fault injection, tests that stall the fsync)
                fsio.fsync_fd(self.fd, "shard", self.path, crossed=crossed)
            self.fsync_s += time.perf_counter() - t
        finally:
            fd, self.fd = self.fd, -1  # abort() after a failed finish() must not close it again:
            os.close(fd)  # by then the number may belong to a file another thread opened
        self.seconds = time.perf_counter() - self.started

    def report(self) -> None:
        """After sync, on the caller's thread (whose thread-local state says, e.g., whether this
        is an emergency save): `on_finish(strategy, bytes, seconds)`."""
        if self.on_finish is not None:
            self.on_finish(self.strategy, self.total, self.seconds)

    def finish(self) -> str:
        """Write what is left, fsync, close. Returns the xxh3 hex digest of all bytes fed."""
        try:
            self.drain()
        except BaseException:
            self.abort()
            raise
        self.sync()
        self.report()
        return self.digest

    def timing(self) -> dict[str, float]:
        """Seconds of this shard's write (after finish): `shard_s` open to fsynced, `write_s` in
        write calls (thread-seconds), `hash_s` hashing the stream and its block digests (the
        hasher thread's seconds; the caller's thread hashes nothing), `hash_wait_s` the caller
        waiting for the hasher, `fsync_s` the final fsync, `wait_s` the producer waiting for
        the writer."""
        return {k: round(v, 4) for k, v in (
            ("shard_s", self.seconds), ("write_s", self.write_s), ("hash_s", self.hashing.seconds),
            ("hash_wait_s", self.hash_wait_s), ("fsync_s", self.fsync_s),
            ("wait_s", self.wait_s))}

    def abort(self) -> None:
        if any(t.is_alive() for t in self.threads):
            self._stop_writers()
        try:
            self.hashing.close()
        except BaseException:  # noqa: BLE001, S110 - the write failed already: that error is raised
            pass
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            try:
                os.close(fd)
            except OSError:
                pass

    def _stop_writers(self) -> None:
        for _ in self.threads:
            self.q.put(None)
        for t in self.threads:
            t.join()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    # -- writer threads --------------------------------------------------------------------

    def _writer(self) -> None:
        while (item := self.q.get()) is not None:
            idx, filled, offset = item
            try:
                if self.error is None:
                    padded = -(-filled // ALIGN) * ALIGN
                    if padded != filled:
                        self.bufs[idx][filled:padded] = 0
                    t = time.perf_counter()
                    fsio.pwrite_all(self.fd, self.bufs[idx][:padded].data, offset, "shard.data", self.path)
                    self.write_s += time.perf_counter() - t
            except BaseException as exc:  # handed to the producer, raised on its thread
                self.error = exc
            finally:
                self.free[idx].release()


    def _buffered_writer(self) -> None:
        written, stop = 0, False
        while not stop:
            batch = [self.q.get()]
            while batch[-1] is not None and len(batch) < BATCH:  # what else waits: one writev for all
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            views = [v for v in batch if v is not None]
            try:
                if self.error is None and views:
                    t = time.perf_counter()
                    fsio.writev_all(self.fd, views, "shard.data", self.path)
                    written += sum(len(v) for v in views)
                    if self.strategy == "buffered-wb":
                        self._writeback(written)
                    self.write_s += time.perf_counter() - t
            except BaseException as exc:  # handed to the producer, raised on its thread
                self.error = exc


    def _parallel_writer(self) -> None:
        """One of PAR_THREADS threads on a shared queue of (view, offset): takes what waits (in
        queue order, so mostly contiguous), writes each contiguous run with one pwritev. The
        first error stops every thread's writes and is raised on the producer's thread."""
        spent, stop = 0.0, False
        while not stop:
            batch = [self.q.get()]
            while batch[-1] is not None and len(batch) < BATCH:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            stop = batch[-1] is None
            try:
                for views, offset in _runs([b for b in batch if b is not None]):
                    if self.error is not None:
                        break
                    t = time.perf_counter()
                    fsio.pwritev_all(self.fd, views, offset, "shard.data", self.path)
                    spent += time.perf_counter() - t
            except BaseException as exc:  # handed to the producer, raised on its thread
                self.error = exc
        with self._sum:
            self.write_s += spent


def _runs(items: list[tuple[memoryview | bytes, int]]) -> list[tuple[list[memoryview | bytes], int]]:
    """(views, offset) of each contiguous run of (view, offset) items, in their order. Pure."""
    runs: list[tuple[list[memoryview | bytes], int]] = []
    end = -1
    for view, offset in items:
        if runs and offset == end:
            runs[-1][0].append(view)
        else:
            runs.append(([view], offset))
        end = offset + len(view)
    return runs


def tensor_bytes(t: Any) -> memoryview:
    """A contiguous CPU tensor's bytes, without a copy."""
    import torch

    flat = t.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")

"""The publisher of one rank's failure-time snapshots (train/failsave.py): the training thread only
takes what must be taken at that moment (`stepsnap.grab`: copies of values that will change, the
RNG states) and hands it here; the publisher encodes it and writes it to every sink
of its slot (`FileSink`: a node-local slot file; a slot may have more than one sink). On its own
thread (`background`), or inline on the caller's (the same jobs, written before `submit`
returns): which one costs a step less depends on the machine (docs/benchmarks.md: on a box whose
cores the ranks already fill, the thread's GIL hand-offs cost more than the work it moves).

Rules:
  - jobs are prepared in the order they were submitted (`prepare`: the tail comparisons of
    failsave depend on that order), on this one thread;
  - coalescing: a job whose slot already has a newer job queued is prepared but not written (if
    the thread falls behind, the newest capture of each slot wins); one thread writes, so two
    writes of one slot never interleave;
  - `drain` returns once everything submitted before it is written (a survivor drains before
    it reports its status); `stop` ends publishing for good: nothing submitted afterwards, nor
    anything still queued, is written;
  - an error (a full disk, an encoding bug) stops publishing for good, with one warning: from
    then on this rank's slots lag, and a failure save that would need them is refused (a slot
    that lags is never read as a newer step: every record names its own step).
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

log = logging.getLogger("slurmresume")

MAP_BYTES = 64 << 10  # a slot's mapped bytes (`FileSink`): a DDP rank's record is a few KB
MAX_PENDING = 16  # queued jobs before `submit` waits (the thread is ~8 steps behind: never in practice)

Encode = Callable[[], list[bytes]]
Prepare = Callable[[], Encode]


class Sink(Protocol):
    def write(self, parts: list[bytes]) -> None: ...

    def close(self) -> None: ...


class FileSink:
    """One slot file, rewritten in place at offset 0 (a longer record left behind is cut by the
    header's lengths; a record torn by a kill fails its checksum). A record of up to MAP_BYTES is
    copied into a shared mapping of the file's first MAP_BYTES, which costs a capture about half
    of a pwritev on a cache the step evicted (docs/benchmarks.md, #47); a longer one, or any
    record once the mapping could not be made, takes one pwritev. The mapped bytes are allocated
    up front (`posix_fallocate`): a full node-local file system refuses the mapping here, with
    one warning, rather than a page fault killing the rank later (SIGBUS)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        self._map: mmap.mmap | None = None
        try:
            os.posix_fallocate(self.fd, 0, MAP_BYTES)
            self._map = mmap.mmap(self.fd, MAP_BYTES)
        except (OSError, ValueError, AttributeError) as exc:
            log.warning("snapshot slot %s: written by pwritev (%s: %s)", path.name, type(exc).__name__, exc)

    def write(self, parts: list[bytes]) -> None:
        m = self._map
        if m is not None:
            record = b"".join(parts)
            if len(record) <= MAP_BYTES:
                m[:len(record)] = record
                return
        os.pwritev(self.fd, parts, 0)

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
        os.close(self.fd)


class Publisher:
    """One per rank; see the module docstring. The training thread's side (`submit`) is a counter
    and a put on a C queue; the waiting (`drain`, a full queue) is on `_cond`."""

    def __init__(self, sinks: Mapping[str, Sequence[Sink]], name: str = "slurmresume-snapshots", *,
                 background: bool = True) -> None:
        self.sinks: dict[str, list[Sink]] = {slot: list(s) for slot, s in sinks.items()}
        self._inbox: queue.SimpleQueue[tuple[int, str, Prepare] | None] = queue.SimpleQueue()
        self._seq = threading.Lock()  # _submitted and _newest, with the put that goes with them
        self._cond = threading.Condition()  # _done moved, or publishing stopped
        self._write = threading.Lock()  # held while a record goes to its sinks
        self._newest: dict[str, int] = {}  # slot -> sequence number of its newest job submitted
        self._submitted = 0
        self._done = 0  # the last job finished (written, coalesced or dropped); jobs finish in order
        self._stopped = False
        self.failed: str | None = None
        self.written = 0  # records written (all sinks of a slot: one)
        self.background = background
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        if background:
            self._thread.start()

    def submit(self, slot: str, prepare: Prepare) -> bool:
        """Queue a capture for `slot` (training thread; waits only while MAX_PENDING are queued).
        False: publishing stopped, the capture is dropped."""
        if self._stopped:
            return False
        if not self.background:  # inline: on the caller's thread, written when this returns
            return self._inline(slot, prepare)
        if self._inbox.qsize() >= MAX_PENDING:
            with self._cond:
                while self._inbox.qsize() >= MAX_PENDING and not self._stopped:
                    self._cond.wait(1.0)
        with self._seq:
            self._submitted += 1
            self._newest[slot] = self._submitted
            self._inbox.put((self._submitted, slot, prepare))
        return True

    def drain(self, timeout: float) -> bool:
        """Wait until every job submitted before this call is finished; False on timeout or when
        publishing stopped with jobs unwritten."""
        deadline = time.monotonic() + timeout
        with self._write if not self.background else self._seq:  # inline: no job half-counted
            target = self._submitted
        with self._cond:
            while self._done < target and not self._stopped:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return self._done >= target and self.failed is None

    def stop(self) -> None:
        """Publish nothing more: returns once a write under way finished; nothing is written after."""
        with self._write, self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._inbox.put(None)  # wakes the thread, which ends

    def close(self, timeout: float = 5.0) -> None:
        """Drain, stop, close the sinks (a normal end)."""
        self.drain(timeout)
        self.stop()
        if self.background:
            self._thread.join(timeout)
        if not self._thread.is_alive():
            for sinks in self.sinks.values():
                for sink in sinks:
                    sink.close()

    def _inline(self, slot: str, prepare: Prepare) -> bool:
        """`submit` without the thread: prepared, encoded and written here, in one go (counted
        under `_write`, which `drain` also takes: a drain sees a job either done or not begun)."""
        try:
            parts = prepare()()
            with self._write:  # once stop() returned, nothing more is written
                if self._stopped:
                    return False
                for sink in self.sinks.get(slot, ()):
                    sink.write(parts)
                self.written += 1
                self._submitted += 1
                self._done = self._newest[slot] = self._submitted
        except Exception as exc:  # noqa: BLE001 - as on the thread (`_run`)
            self._fail(exc)
            return False
        return True

    def _fail(self, exc: Exception) -> None:
        log.warning("failure-time snapshots stopped on this rank (%s: %s): a failure save that "
                    "needs them will be refused", type(exc).__name__, exc)
        with self._cond:
            self.failed = f"{type(exc).__name__}: {exc}"
            self._stopped = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None or self._stopped:
                return
            seq, slot, prepare = item
            try:
                encode = prepare()  # always, in order (the tail comparisons)
                with self._seq:
                    write = self._newest.get(slot) == seq  # else a newer capture of the slot is queued
                if write:
                    parts = encode()
                    with self._write:  # once stop() returned, nothing more is written
                        if not self._stopped:
                            for sink in self.sinks.get(slot, ()):
                                sink.write(parts)
                            self.written += 1
            except Exception as exc:  # noqa: BLE001 - this rank's slots lag from now on: refusals, never a mix
                self._fail(exc)
                return
            with self._cond:
                self._done = seq
                self._cond.notify_all()

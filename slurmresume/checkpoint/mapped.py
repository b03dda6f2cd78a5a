"""Shard bytes read through a shared read-only mapping instead of `pread` (the memory tier's restore).

A restore from the memory tier (train/memrestore.py) reads files on this job's own tmpfs, whose
pages are memory: a `pread` there is a kernel copy of every byte, so its two passes (verify all,
then read into the live tensors: all or nothing) copied each byte twice and hashed it twice. Through
a mapping, the first pass hashes the file's own pages (no copy) and the second copies them once
into the live tensors (and hashes the block just landed, while it is in cache: a file changed
between the passes is still caught, as in the `pread` path). Measured: scripts/bench_memtier.py.

Only where the caller asks (`reading_mapped`, around one restore): a mapping of a file that
shrinks while mapped kills the reader with SIGBUS instead of raising, which a shared file system
written by others could do, and the memory tier's files cannot: they are this job's, written once
before their commit marker, never truncated, and only unlinked (which keeps a mapped inode alive).
Each file is opened and size-checked as for a `pread` (`shardread.open_checked`), and a range past
its end is refused before it is mapped. Anything that cannot be mapped is read with `pread`.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from ..errors import CorruptCheckpointError

_WANTED: ContextVar[bool] = ContextVar("slurmresume_mapped_reads", default=False)


@contextmanager
def reading_mapped() -> Iterator[None]:
    """Within: the restores started (their `opened.OpenShards`) read through mappings."""
    token = _WANTED.set(True)
    try:
        yield
    finally:
        _WANTED.reset(token)


def wanted() -> bool:
    return _WANTED.get()


class Mappings:
    """One restore's mappings, by (fd, offset, length): made on first use (its pages populated
    in one call), reused by the second pass, unmapped by `close()`."""

    def __init__(self) -> None:
        self._maps: dict[tuple[int, int, int], tuple[mmap.mmap, memoryview]] = {}

    def view(self, fd: int, offset: int, length: int, path: object) -> memoryview | None:
        """The `length` bytes of `fd` at `offset`, read-only and uncopied; None when they cannot
        be mapped (the caller reads them with `pread`). A range past the end of the file: raised."""
        if length <= 0:
            return None
        key = (fd, offset, length)
        got = self._maps.get(key)
        if got is None:
            try:
                size = os.fstat(fd).st_size
            except OSError:
                return None
            if offset < 0 or offset + length > size:
                raise CorruptCheckpointError(f"shard {path}: bytes {offset}..{offset + length} are past its end ({size})")
            base = offset - offset % mmap.ALLOCATIONGRANULARITY
            try:
                m = mmap.mmap(fd, offset + length - base, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                              prot=mmap.PROT_READ, offset=base)
            except (OSError, ValueError):
                return None
            got = self._maps[key] = (m, memoryview(m)[offset - base :])
        return got[1]

    def close(self) -> None:
        for m, view in self._maps.values():
            view.release()
            try:
                m.close()
            except BufferError:  # a view still held somewhere: unmapped when it is dropped
                pass
        self._maps.clear()

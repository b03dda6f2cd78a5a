"""One shard from the bucket into a new local file, hashed while it arrives, one fsync at the end.

The object is cut into parts (`part_size`, chosen from the object's size) fetched by the pool's
threads with ranged GETs (`ranges.fetch_range`: a cut part resumes at its first missing byte),
each written with `pwrite` at its own offset into the file, sized up front. The parts are handed
out in order, so they finish roughly in order; the calling thread follows them: as soon as part
i is written it reads it back from the file (from the page cache, through a mapping: no copy)
into one xxh3 stream and hands the range to the kernel's writeback, then waits for part i+1.
So the checksum covers the bytes the file holds, as a second pass over the file did, but
overlaps the download instead of following it, and the one fsync at the end finds little left
to write.
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import xxhash

from ..checkpoint import fsio
from ..checkpoint.writeback import WRITE, sync_file_range
from ..errors import CorruptCheckpointError
from ..storage.s3 import S3Location
from ..storage.settings import MirrorSettings
from .ranges import fetch_range

MIB = 1 << 20
MIN_PART = 8 * MIB  # below this, the requests' own cost shows (boto3's transfer manager uses 8 MiB)
MAX_PART = 64 * MIB  # above this, the last parts keep few threads busy, and the hash trails far behind
PARTS_PER_WORKER = 4


def part_size(size: int, workers: int) -> int:
    """Bytes per ranged GET for an object of `size` bytes and `workers` threads: about
    PARTS_PER_WORKER parts per thread (the pool stays busy to the end; the hash follows closely),
    a whole number of MiB within [MIN_PART, MAX_PART]."""
    target = -(-size // max(1, workers * PARTS_PER_WORKER))
    return max(MIN_PART, min(MAX_PART, -(-target // MIB) * MIB))


def fetch_shard(s3: Any, loc: S3Location, key: str, path: Path, size: int, pool: ThreadPoolExecutor, *,
                part: int, settings: MirrorSettings, deadline: float | None) -> str:
    """Write the `size`-byte object `key` into the new file `path` (fsynced) and return the
    xxh3 of the bytes the file holds. Raises CheckpointError (a part's tries spent, or the
    deadline) or CorruptCheckpointError (the file cannot be read back)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.ftruncate(fd, size)
        ranges = [(off, min(off + part, size)) for off in range(0, size, part)]
        futures = [pool.submit(fetch_range, s3, loc, key, fd, a, b, settings, deadline) for a, b in ranges]
        hasher = xxhash.xxh3_64()
        try:
            for fut, (a, b) in zip(futures, ranges):
                fut.result()
                _hash_range(fd, hasher, a, b, path)
                if sync_file_range is not None:  # start the writeback of what is hashed
                    sync_file_range(fd, a, b - a, WRITE)
        except BaseException:
            # The other parts stop (waiting ones) or end (running ones, bounded by their tries)
            # before `fd` is closed: a number closed under a running part could be reused by
            # another file, which that part would then write into.
            for fut in futures:
                fut.cancel()
            wait(futures)
            raise
        fsio.fsync_fd(fd, "mirror.shard", path)
        return hasher.hexdigest()
    finally:
        os.close(fd)


def _hash_range(fd: int, hasher: Any, start: int, end: int, path: Path) -> None:
    """Add bytes [start, end) of the file to `hasher` (`start` is a multiple of the page size)."""
    try:
        with mmap.mmap(fd, end - start, prot=mmap.PROT_READ, offset=start) as view:
            hasher.update(view)
    except (OSError, ValueError) as exc:
        raise CorruptCheckpointError(f"cannot read {path} back after download: {exc}") from exc

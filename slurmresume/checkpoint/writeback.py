"""Early writeback: `sync_file_range(2)` from libc, for the writers of large files.

Handing a written range to the kernel's writeback at once (`WRITE`) keeps the page cache from
piling up dirty pages that the final fsync would then have to write in one go. Used by the
shard writer's `buffered-wb` path (checkpoint/writer.py) and the mirror's downloads
(mirror/download.py). `sync_file_range` is None where libc lacks it; a caller then writes
plainly, and its fsync alone makes the bytes durable.
"""

from __future__ import annotations

import ctypes
from typing import Any

WAIT_BEFORE, WRITE, WAIT_AFTER = 1, 2, 4  # SYNC_FILE_RANGE_* flags


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range  # ctypes releases the GIL
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


# sync_file_range(fd, offset, nbytes, flags) -> 0, or -1 with ctypes.get_errno(); None if absent
sync_file_range = _libc_sync_file_range()

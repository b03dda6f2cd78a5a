"""Reading a small file of a step (marker, manifest, tensor index) with a size cap, refusing links
and special files; what every reader of those files goes through."""

from __future__ import annotations

from pathlib import Path

from ..errors import CorruptCheckpointError, UnreadableCheckpointError, UnsafeCheckpointError
from . import fsio


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    import os
    import stat

    label = f"read.{what.replace(' ', '_')}"
    try:
        fd = fsio.retry_transient(label, path, lambda: os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what} {path} is missing") from None
    except OSError as exc:
        if exc.errno in fsio.TRANSIENT_ERRNOS:
            raise CorruptCheckpointError(f"cannot read {what} {path}: {exc.strerror} (after retries)") from None
        raise UnsafeCheckpointError(f"refusing {what} {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"refusing {what} {path}: not a regular file")
        if st.st_size > limit:  # not corrupt: a bigger file may be a valid step this version cannot read
            raise UnreadableCheckpointError(f"{what} {path} is {st.st_size} bytes, over this version's read cap "
                                            f"of {limit} bytes: unreadable by this version (kept, never deleted)")
        try:
            # Sized from fstat, not the cap: a 4 KiB marker or a 0.2 MiB manifest no longer allocates
            # the 64 MiB cap on every scan and pick. One byte more shows a file that grew since the
            # fstat; then it is read as before, up to the cap and one byte.
            size = min(st.st_size, limit) + 1
            raw = fsio.retry_transient(label, path, lambda: os.pread(fd, size, 0))
            if len(raw) == size and size <= limit:
                raw = fsio.retry_transient(label, path, lambda: os.pread(fd, limit + 1, 0))
            return raw
        except OSError as exc:
            raise CorruptCheckpointError(f"cannot read {what} {path}: {exc.strerror} (after retries)") from None
    finally:
        os.close(fd)

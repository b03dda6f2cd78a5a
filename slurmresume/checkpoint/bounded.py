"""Reading a small file of a step (marker, manifest, tensor index) with a size cap, refusing links
and special files; what every reader of those files goes through."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import (
    CorruptCheckpointError,
    NotPermittedError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
)
from . import fsio

# What a step (or a file of it) this user may not read is: never "corrupt" (see NotPermittedError)
UNREADABLE = "unreadable by this user (permission denied): fix with chmod/chown, or ask its owner"


def open_regular(path: Path, what: str, label: str, verb: str = "read", hint: str = "") -> tuple[int, os.stat_result]:
    """An fd (O_NOFOLLOW: a link fails) and its fstat for a plain regular file of a step, opened
    with `fsio.retry_transient` under `label`. CorruptCheckpointError when it is missing or still
    failing after retries ("cannot {verb} {what} ..."); NotPermittedError when this user may not
    read it (another user's file: unreadable here, not corrupt); UnsafeCheckpointError for a link
    or a special file (`hint` appended to the open's refusal). The one opener of `read_bounded`
    and `shardread.open_checked`."""
    try:
        fd = fsio.retry_transient(label, path, lambda: os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{what} {path} is missing") from None
    except PermissionError:  # EACCES, EPERM: the file is there, its mode or owner is not ours
        raise NotPermittedError(f"{what} {path} is {UNREADABLE}", path) from None
    except OSError as exc:
        if exc.errno in fsio.TRANSIENT_ERRNOS:
            raise CorruptCheckpointError(f"cannot {verb} {what} {path}: {exc.strerror} (after retries)") from None
        raise UnsafeCheckpointError(f"refusing {what} {path}: {exc.strerror}{hint}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafeCheckpointError(f"refusing {what} {path}: not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_bounded(path: Path, limit: int, what: str) -> bytes:
    label = f"read.{what.replace(' ', '_')}"
    fd, st = open_regular(path, what, label)
    try:
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

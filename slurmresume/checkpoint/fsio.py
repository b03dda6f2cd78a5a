"""Durable file-system operations, and the one seam tests use to crash or fail them.

Every step that matters for durability goes through `fault_point(label, path)`. In production
it is a no-op (one global lookup). Tests set, before the process starts:

  SLURMRESUME_TEST_KILL_AT="label[:N]"   SIGKILL this process at the N-th (default 1st)
                                         crossing of `label` (prefix match: "fsync" hits
                                         "fsync.shard", "fsync.manifest", ...)
  SLURMRESUME_TEST_FAIL_AT="label[:N]"   raise OSError(EIO) there instead
  SLURMRESUME_TEST_TRACE=path            append every label crossed to that file
  SLURMRESUME_TEST_NO_RENAME_EXCHANGE=1  `exchange` answers "unsupported", as on NFS, Lustre
                                         or GPFS (the two-rename replace of replace.py)

This is a test-only hook: it is read once at import time and never from a checkpoint.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

_counts: dict[str, int] = {}


def _parse(spec: str | None) -> tuple[str, int] | None:
    if not spec:
        return None
    label, _, n = spec.partition(":")
    return label, int(n or 1)


_KILL = _parse(os.environ.get("SLURMRESUME_TEST_KILL_AT"))
_FAIL = _parse(os.environ.get("SLURMRESUME_TEST_FAIL_AT"))
_TRACE = os.environ.get("SLURMRESUME_TEST_TRACE")
_ACTIVE = bool(_KILL or _FAIL or _TRACE)
_NO_EXCHANGE = os.environ.get("SLURMRESUME_TEST_NO_RENAME_EXCHANGE") == "1"


def fault_point(label: str, path: str | os.PathLike[str] = "") -> None:
    if not _ACTIVE:
        return
    if _TRACE:
        with open(_TRACE, "a") as f:
            f.write(f"{label}\n")
    for spec, act in ((_KILL, "kill"), (_FAIL, "fail")):
        if spec and label.startswith(spec[0]):
            key = f"{act}:{spec[0]}"
            _counts[key] = _counts.get(key, 0) + 1
            if _counts[key] == spec[1]:
                if act == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(errno.EIO, f"injected I/O error at {label}", str(path))


# A read that fails with one of these may succeed when repeated (NFS ESTALE after a server-side
# rename, a flaky block device or network file system): retried, boundedly, before a checkpoint
# is declared unreadable. About 0.8 s in all.
TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EINTR})
TRANSIENT_DELAYS = (0.05, 0.2, 0.5)


def retry_transient(label: str, path: str | os.PathLike[str], fn: Callable[[], T]) -> T:
    """Run `fn` (a read); repeat it after a transient OSError (TRANSIENT_ERRNOS), at most
    len(TRANSIENT_DELAYS) more times; the last error propagates, noted with `label` and `path`.
    Deliberately not a fault point: an injected single EIO is meant to be absorbed here, while the
    campaigns expect every labelled point to surface its error (tests fake `os` calls instead)."""
    import time

    for delay in (*TRANSIENT_DELAYS, None):
        try:
            return fn()
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS or delay is None:
                raise
            import logging

            logging.getLogger("slurmresume").warning("%s of %s: %s; retrying in %.2f s", label, path, exc, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")


def fsync_fd(fd: int, label: str, path: str | os.PathLike[str] = "", *, crossed: bool = False) -> None:
    """fsync `fd`, crossing its fault point first; `crossed`: the caller crossed it already (on
    its own thread, so that labels keep their order while this fsync runs on another)."""
    if not crossed:
        fault_point(f"fsync.{label}", path)
    os.fsync(fd)


def fsync_dir(path: Path, label: str) -> None:
    fault_point(f"fsyncdir.{label}", path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rename(src: Path, dst: Path, label: str) -> None:
    fault_point(f"rename.{label}", dst)
    os.replace(src, dst)


def exchange(a: Path, b: Path, label: str) -> bool:
    """Swap two directory entries atomically (Linux renameat2 RENAME_EXCHANGE). False when the
    kernel or file system does not support it (the caller falls back); OSError otherwise."""
    import ctypes

    fault_point(f"rename.{label}", b)
    fn = None if _NO_EXCHANGE else getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(b))


def write_all(fd: int, data: memoryview | bytes, label: str, path: str | os.PathLike[str] = "") -> None:
    fault_point(f"write.{label}", path)
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def writev_all(fd: int, views: list[memoryview | bytes], label: str, path: str | os.PathLike[str] = "") -> None:
    """`write_all` of several buffers with writev (from their own memory, one system call for
    many small tensors): the same fault point, once per buffer (as many crossings as separate
    writes would make, whatever the batching: campaigns count them)."""
    for _ in views:
        fault_point(f"write.{label}", path)
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    while pending:
        n = os.writev(fd, pending[:1024])  # IOV_MAX on Linux
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]


def pwrite_all(fd: int, data: memoryview | bytes, offset: int, label: str, path: str | os.PathLike[str] = "") -> None:
    """`write_all` at a file offset (several writer threads on one file): the same fault point."""
    fault_point(f"write.{label}", path)
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def pwritev_all(fd: int, views: list[memoryview | bytes], offset: int, label: str,
                path: str | os.PathLike[str] = "") -> None:
    """`writev_all` at a file offset (the parallel buffered writers, each on its own ranges of
    one file): the same fault point, once per buffer."""
    for _ in views:
        fault_point(f"write.{label}", path)
    pending = [memoryview(v).cast("B") for v in views if len(v)]
    while pending:
        n = os.pwritev(fd, pending[:1024], offset)  # IOV_MAX on Linux
        offset += n
        while pending and n >= len(pending[0]):
            n -= len(pending[0])
            pending.pop(0)
        if n:
            pending[0] = pending[0][n:]


def note_failure(exc: BaseException, path: str | os.PathLike[str], needed: int | None = None) -> None:
    """Attach to a failed write's OSError which file it was writing and how many bytes that
    file needs, so that the error message can name both (ENOSPC: "... bytes needed")."""
    if isinstance(exc, OSError):
        if getattr(exc, "slurmresume_path", None) is None:
            exc.slurmresume_path = os.fspath(path)  # type: ignore[attr-defined]
        if needed is not None and getattr(exc, "slurmresume_needed", None) is None:
            exc.slurmresume_needed = needed  # type: ignore[attr-defined]
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and getattr(exc, "slurmresume_free", None) is None:
            # as it was when the write failed: a clean-up (another thread's, or the caller's) may
            # free space or an inode before the message is written
            exc.slurmresume_free = free_space(Path(path))  # type: ignore[attr-defined]


def free_space(path: Path) -> tuple[int, int | None]:
    """(bytes free to this user, inodes free or None when the file system does not count them)
    of the nearest existing directory at or above `path`; (-1, None) when unknown."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files else None)
    return -1, None


def write_durable(path: Path, data: bytes, label: str, mode: int = 0o644, *, sync_dir: bool = True) -> None:
    """Write `data` to `path` atomically and durably: temp file, fsync, rename, dir fsync (left to
    the caller with `sync_dir=False`, who fsyncs the directory once for several files)."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
    except BaseException as exc:
        note_failure(exc, path, len(data))
        raise
    try:
        write_all(fd, data, label, tmp)
        fsync_fd(fd, label, tmp)
    except BaseException as exc:
        os.close(fd)
        _unlink_quiet(tmp)
        note_failure(exc, path, len(data))
        raise
    os.close(fd)
    try:
        rename(tmp, path, label)
    except BaseException as exc:
        _unlink_quiet(tmp)
        note_failure(exc, path, len(data))
        raise
    if not sync_dir:
        return
    try:
        fsync_dir(path.parent, label)
    except BaseException as exc:
        note_failure(exc, path.parent)
        raise


def fs_type(path: Path, mounts: str) -> tuple[str, str]:
    """(filesystem type, mount point) of `path` from /proc/mounts text: the longest prefix."""
    best = ("unknown", "")
    real = str(path.resolve())
    for line in mounts.splitlines():
        f = line.split()
        if len(f) >= 3:
            mnt = f[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (f[2], mnt)
    return best


def makedirs(path: Path, mode: int = 0o755) -> None:
    """`mkdir -p` where every directory created gets `mode` (less the umask). Path.mkdir(parents=True)
    gives the parents 0o777 less the umask: group- or world-writable under umask 002 / 000."""
    missing = []
    p = Path(path)
    while not p.is_dir():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            if not d.is_dir():
                raise


def umask() -> int:
    """This process's umask, read without changing it (os.umask() would, for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def unlink(path: Path, label: str) -> None:
    fault_point(f"unlink.{label}", path)
    os.unlink(path)


def remove_tree(path: Path) -> bool:
    """Remove `path`: a directory with everything in it, or a file or link (never followed).
    True only when this call removed it: it was there, every removal succeeded and it is gone.
    False when it could not be removed (what is left stays), or vanished or was taken (renamed
    away) by another process meanwhile: callers report only what they actually removed."""
    failed: list[object] = []
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if stat.S_ISDIR(st.st_mode):
        try:  # (a replaced rmtree, the crash campaign's, may raise instead of calling back)
            if sys.version_info >= (3, 12):
                shutil.rmtree(path, onexc=lambda *a: failed.append(a))
            else:
                shutil.rmtree(path, onerror=lambda *a: failed.append(a))
        except OSError:
            return False
    else:
        try:
            os.unlink(path)
        except OSError:
            return False
    return not failed and not os.path.lexists(path)


def _unlink_quiet(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass

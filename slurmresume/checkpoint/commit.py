"""How a step becomes durable: prepare (rank 0), write shards (all ranks), commit (rank 0).

Durability order (DESIGN.md section 1):
  1. rank 0, under the root lock: create step_N/ and its .inprogress note (a stale partial
     step_N/ from a killed save is moved aside first); the decision is broadcast.
  2. every rank: its shard to a temp name, fsync, rename, fsync step_N/.
  3. all ranks report (size, checksum, tensor index) to rank 0.
  4. rank 0: manifest.json (temp, fsync, rename), then, under the lock, COMMITTED (temp, fsync,
     rename), drop .inprogress, fsync step_N/ and the root. The outcome is broadcast, so no rank
     returns "saved" before the marker is durable.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from filelock import FileLock

from ..errors import SaveError
from . import fsio
from .collective import Group
from .jsonenc import dumps
from .layout import (
    DELETING_PREFIX,
    INPROGRESS,
    LOCK,
    MANIFEST,
    MARKER,
    REPLACING_PREFIX,
    shard_name,
    step_dir_name,
)
from .manifest import build_manifest, marker_bytes
from .shard import SKELETON_KEY, write_shard
from .store import inspect_dir

log = logging.getLogger("slurmresume")

LOCK_TIMEOUT = 120.0


def root_lock(root: Path, timeout: float = LOCK_TIMEOUT) -> FileLock:
    # filelock chmods the file to exactly `mode`: take the umask off, as for every other file
    return FileLock(str(root / LOCK), timeout=timeout, mode=0o644 & ~fsio.umask())


def move_aside(path: Path, label: str = "aside") -> None:
    """Make a step directory invisible in one rename, then delete its files (crash-safe)."""
    hidden = path.with_name(f"{DELETING_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    fsio.rename(path, hidden, f"delete.{label}")
    fsio.fsync_dir(path.parent, f"delete.{label}")
    shutil.rmtree(hidden, ignore_errors=True)


def prepare(root: Path, step: int, replace: bool = False) -> dict[str, Any]:
    """Rank 0. Returns {"action": "write"|"skip"|"error", "dir": name, ...}; never raises.
    "dir" is the directory every rank writes into: the step directory itself, or, with
    `replace` and a complete committed step, a hidden staging directory that `commit` swaps in
    only once it is committed itself (the step is never without a complete checkpoint)."""
    d = root / step_dir_name(step)
    created = False
    try:
        fsio.makedirs(root, 0o755)
        with root_lock(root):
            if (d / MARKER).exists():
                info = inspect_dir(step, d)  # manifest + sizes; a corrupt one is rewritten
                if info.complete and not replace:
                    return {"action": "skip", "reason": f"step {step} is already committed at {d}"}
                if info.complete:
                    for old in root.glob(f"{REPLACING_PREFIX}{d.name}.*"):  # a killed replace's leftover
                        move_aside(old, "stale")
                    d = root / f"{REPLACING_PREFIX}{d.name}.{uuid.uuid4().hex[:8]}"
                else:
                    log.warning("replacing %s: committed but unusable (%s)", d, info.problem)
            if d.exists() or d.is_symlink():
                move_aside(d, "stale")
            d.mkdir(mode=0o755)
            created = True
            note = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            fsio.write_durable(d / INPROGRESS, dumps(note).encode(), "inprogress")
            fsio.fsync_dir(root, "root")
        return {"action": "write", "dir": d.name}
    except Exception as exc:
        error = _describe(exc, root)  # before the clean-up frees space or inodes
        if created:
            abandon(d)
        return {"action": "error", "error": error}


def write_rank(root: Path, step: int, group: Group, skeleton: dict, tensors: list,
               replicated: set[str] | None = None, dirname: str | None = None) -> dict[str, Any]:
    """Every rank: write its shard. Returns a report; errors are reported, not raised, so that
    every rank still reaches the gather and nobody deadlocks. Tensors in `replicated` are
    written by rank 0 only (the skeleton lists them, so other ranks read them from shard 0)."""
    if replicated:
        skeleton = {**skeleton, "replicated": sorted(replicated)}
        if group.rank != 0:
            tensors = [(n, t) for n, t in tensors if n not in replicated]
    d = root / (dirname or step_dir_name(step))
    file = shard_name(group.rank, group.world_size)
    try:
        fsio.makedirs(d, 0o755)
        written = write_shard(d, file, tensors, {SKELETON_KEY: dumps(skeleton), "format": "pt"})
        fsio.fsync_dir(d, "step")
        index = written.tensors
        for name, spec in (skeleton.get("dtensors") or {}).items():
            if name in index:  # where this piece sits in its global tensor (manifest index)
                index[name] = {**index[name], "global_shape": spec["shape"], "global_offset": spec["offset"]}
        return {"rank": group.rank, "file": file, "bytes": written.bytes, "xxh3": written.xxh3,
                "header_xxh3": written.header_xxh3, "tensors": index, "replicated": sorted(replicated or ()) if group.rank == 0 else [],
                "error": None}
    except Exception as exc:
        error = _describe(exc, d / file)  # before the clean-up frees space or inodes
        _cleanup_temp(d, file)
        return {"rank": group.rank, "file": file, "error": error}


def commit(root: Path, step: int, reports: list[dict], metrics: Any, meta: Any,
           dirname: str | None = None) -> dict[str, Any]:
    """Rank 0: manifest, then the marker. Returns {"ok": bool, "error"?, "path"}. When `dirname`
    is a staging directory (a replace), it is swapped with the step directory once committed."""
    final = root / step_dir_name(step)
    d = root / (dirname or final.name)
    files = [r["file"] for r in reports if isinstance(r.get("file"), str)]
    errors = [r["error"] for r in reports if r.get("error")]
    if errors:
        abandon(d, files)
        return {"ok": False, "error": errors[0]}
    try:
        manifest = build_manifest(step, reports, metrics, meta)
        raw = dumps(manifest).encode()
        fsio.write_durable(d / MANIFEST, raw, "manifest")
        with root_lock(root):
            try:
                fsio.write_durable(d / MARKER, marker_bytes(step, raw), "marker")
                fsio.unlink(d / INPROGRESS, "inprogress")
                fsio.fsync_dir(d, "step")
                fsio.fsync_dir(root, "root")
                if d != final:
                    _swap_in(d, final, root)
                    d = final
            except BaseException:
                # The marker may already be in place (a failed fsync after its rename): take it
                # back before releasing the lock, so that no prune or restore counts a step the
                # caller is told was not committed.
                fsio._unlink_quiet(d / MARKER)
                raise
        return {"ok": True, "path": str(d)}
    except Exception as exc:
        error = _describe(exc, d)  # before the clean-up frees space or inodes
        abandon(d, files)
        return {"ok": False, "error": error}


def _swap_in(staged: Path, final: Path, root: Path) -> None:
    """Under the root lock: the committed staging directory takes the step directory's name.
    With renameat2(RENAME_EXCHANGE) the step name always points at a complete checkpoint; where
    the file system lacks it, the old directory is renamed aside first, leaving the name absent
    for one rename (a reader then falls back to an older step, never to a partial one)."""
    if not fsio.exchange(staged, final, "replace"):
        hidden = final.with_name(f"{DELETING_PREFIX}{final.name}.{uuid.uuid4().hex[:8]}")
        fsio.rename(final, hidden, "replace.aside")
        try:
            fsio.rename(staged, final, "replace")
        except BaseException:
            fsio.rename(hidden, final, "replace.back")  # the old checkpoint goes back in place
            raise
        staged = hidden
    fsio.fsync_dir(root, "root")
    move_aside(staged, "replaced")  # now holds the old checkpoint


def abandon(d: Path, files: list[str] | tuple[str, ...] = ()) -> None:
    """After a failed save (every rank has reported): no commit marker may remain, and the
    failed step's files must not keep holding disk space (on a full disk they would make the
    next save fail too). Best effort; the directory stays, incomplete, and is replaced by the
    next save of that step. The `.inprogress` note goes last, so the directory no longer looks
    like one being written by this (still running) process."""
    for name in (MARKER, MANIFEST, *files):
        fsio._unlink_quiet(d / name)
    try:
        for p in d.glob(".*.tmp.*"):
            fsio._unlink_quiet(p)
    except OSError:
        pass
    fsio._unlink_quiet(d / INPROGRESS)


def _cleanup_temp(d: Path, file: str) -> None:
    try:
        for p in d.glob(f".{file}.tmp.*"):
            p.unlink()
    except OSError:
        pass


def _describe(exc: BaseException, path: Path) -> str:
    """One line: what failed, on which file, and (disk full) how much space is free and needed."""
    import errno

    where = Path(getattr(exc, "slurmresume_path", None) or path)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        needed = getattr(exc, "slurmresume_needed", None)
        free, inodes = _free_space(where)
        what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        need = f", {needed} bytes needed" if needed is not None else ""
        ino = "; no free inodes left (the file system ran out of files, not bytes)" if inodes == 0 else ""
        return (f"{what} while writing {where} ({free} bytes free{need}{ino}): "
                "free space or point the checkpoint root elsewhere")
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP and Path(exc.filename or "").name == LOCK:
        return (f"lock file {exc.filename} is a symbolic link: refusing to follow it; inspect it, remove it "
                f"(rm {exc.filename}) and retry")
    if isinstance(exc, PermissionError):
        return f"permission denied writing {where}: make the checkpoint root writable or choose another"
    return f"{type(exc).__name__} while writing {where}: {exc}"


def _free_space(path: Path) -> tuple[int, int | None]:
    """(bytes free to this user, inodes free or None when the file system does not count them)
    of the nearest existing directory at or above `path`; (-1, None) when unknown."""
    for p in (path, *path.parents):
        try:
            st = os.statvfs(p)
        except OSError:
            continue
        return st.f_bavail * st.f_frsize, (st.f_favail if st.f_files else None)
    return -1, None


def raise_if_failed(outcome: dict[str, Any]) -> None:
    if not outcome.get("ok"):
        raise SaveError(f"checkpoint save failed, nothing committed: {outcome.get('error')}")

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
from .layout import DELETING_PREFIX, INPROGRESS, LOCK, MANIFEST, MARKER, shard_name, step_dir_name
from .manifest import build_manifest, marker_bytes
from .shard import SKELETON_KEY, write_shard
from .store import inspect_dir

log = logging.getLogger("slurmresume")

LOCK_TIMEOUT = 120.0


def root_lock(root: Path, timeout: float = LOCK_TIMEOUT) -> FileLock:
    return FileLock(str(root / LOCK), timeout=timeout, mode=0o644)


def move_aside(path: Path, label: str = "aside") -> None:
    """Make a step directory invisible in one rename, then delete its files (crash-safe)."""
    hidden = path.with_name(f"{DELETING_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    fsio.rename(path, hidden, f"delete.{label}")
    fsio.fsync_dir(path.parent, f"delete.{label}")
    shutil.rmtree(hidden, ignore_errors=True)


def prepare(root: Path, step: int) -> dict[str, Any]:
    """Rank 0. Returns {"action": "write"|"skip"|"error", ...}; never raises."""
    try:
        root.mkdir(parents=True, exist_ok=True, mode=0o755)
        d = root / step_dir_name(step)
        with root_lock(root):
            if (d / MARKER).exists():
                info = inspect_dir(step, d)  # manifest + sizes; a corrupt one is rewritten
                if info.complete:
                    return {"action": "skip", "reason": f"step {step} is already committed at {d}"}
                log.warning("replacing %s: committed but unusable (%s)", d, info.problem)
            if d.exists() or d.is_symlink():
                move_aside(d, "stale")
            d.mkdir(mode=0o755)
            note = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
            fsio.write_durable(d / INPROGRESS, dumps(note).encode(), "inprogress")
            fsio.fsync_dir(root, "root")
        return {"action": "write"}
    except Exception as exc:
        return {"action": "error", "error": _describe(exc, root)}


def write_rank(root: Path, step: int, group: Group, skeleton: dict, tensors: list,
               replicated: set[str] | None = None) -> dict[str, Any]:
    """Every rank: write its shard. Returns a report; errors are reported, not raised, so that
    every rank still reaches the gather and nobody deadlocks. Tensors in `replicated` are
    written by rank 0 only (the skeleton lists them, so other ranks read them from shard 0)."""
    if replicated:
        skeleton = {**skeleton, "replicated": sorted(replicated)}
        if group.rank != 0:
            tensors = [(n, t) for n, t in tensors if n not in replicated]
    d = root / step_dir_name(step)
    file = shard_name(group.rank, group.world_size)
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o755)
        written = write_shard(d, file, tensors, {SKELETON_KEY: dumps(skeleton), "format": "pt"})
        fsio.fsync_dir(d, "step")
        return {"rank": group.rank, "file": file, "bytes": written.bytes, "xxh3": written.xxh3,
                "tensors": written.tensors, "replicated": sorted(replicated or ()) if group.rank == 0 else [],
                "error": None}
    except Exception as exc:
        _cleanup_temp(d, file)
        return {"rank": group.rank, "file": file, "error": _describe(exc, d / file)}


def commit(root: Path, step: int, reports: list[dict], metrics: Any, meta: Any) -> dict[str, Any]:
    """Rank 0: manifest, then the marker. Returns {"ok": bool, "error"?, "path"}."""
    d = root / step_dir_name(step)
    errors = [r["error"] for r in reports if r.get("error")]
    if errors:
        return {"ok": False, "error": errors[0]}
    try:
        manifest = build_manifest(step, reports, metrics, meta)
        raw = dumps(manifest).encode()
        fsio.write_durable(d / MANIFEST, raw, "manifest")
        with root_lock(root):
            fsio.write_durable(d / MARKER, marker_bytes(step, raw), "marker")
            fsio.unlink(d / INPROGRESS, "inprogress")
            fsio.fsync_dir(d, "step")
            fsio.fsync_dir(root, "root")
        return {"ok": True, "path": str(d)}
    except Exception as exc:
        return {"ok": False, "error": _describe(exc, d)}


def _cleanup_temp(d: Path, file: str) -> None:
    try:
        for p in d.glob(f".{file}.tmp.*"):
            p.unlink()
    except OSError:
        pass


def _describe(exc: BaseException, path: Path) -> str:
    import errno

    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        try:
            free = shutil.disk_usage(path if path.exists() else path.parent).free
        except OSError:
            free = -1
        return (f"no space left on device while writing {path} ({free} bytes free): "
                "free space or point the checkpoint root elsewhere")
    if isinstance(exc, PermissionError):
        return f"permission denied writing {path}: make the checkpoint root writable or choose another"
    return f"{type(exc).__name__} while writing {path}: {exc}"


def raise_if_failed(outcome: dict[str, Any]) -> None:
    if not outcome.get("ok"):
        raise SaveError(f"checkpoint save failed, nothing committed: {outcome.get('error')}")

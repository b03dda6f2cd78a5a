"""The memory tier's root on this node: made by the node launcher, removed when the job is done here.

The memory tier (train/memtier.py) is a checkpoint root on node-local tmpfs, in the file tier's
format, so every reader (find_latest, verify, the restore with its checks and fallback) reads it
unchanged. The node launcher (job/node.py `_loop`) owns it:
- `create` at the start of the job on this node, handed to the ranks in $SLURMRESUME_MEMORY_DIR;
- kept across in-allocation restarts (a crashed rank, a hang kill, a failure-save fallback) and
  local restarts: that is what it is for;
- `remove`d when the job ends here (finish, stop, give up, hold) and on a Slurm requeue: the
  next allocation may be other nodes, and tmpfs is RAM that outlives its creator.

A launcher that is SIGKILLed cannot remove its own: the name carries its owner tag
(`hbsweep.owner_tag`), and every launcher sweeps those of launchers that are provably gone
before it makes its own (`hbsweep.sweep`, the same rules as for heartbeat directories).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from .hbsweep import owner_tag, sweep

log = logging.getLogger("slurmresume")

PREFIX = "slurmresume-mem-"
PEERS = "peers"  # the replicas of other nodes' snapshots (job/peercopy.py)
# where the memory roots are made (default /dev/shm); "none": no memory tier on this node (a site
# whose tmpfs is too small, or tests of other features: tests/helpers/procs.clean_env)
ENV_BASE = "SLURMRESUME_MEMORY_BASE"
DEFAULT_BASE = "/dev/shm"


def create(job_key: str, node: int) -> Path | None:
    """The launcher, once per job on this node: a fresh, empty directory private to this user,
    under $SLURMRESUME_MEMORY_BASE (default /dev/shm); None, with one log line, when there is no
    such file system (the job runs with the file tier alone). Directories of launchers that are
    gone are swept first."""
    value = os.environ.get(ENV_BASE) or DEFAULT_BASE
    if value.strip().lower() == "none":
        log.info("memory tier off: %s=none", ENV_BASE)
        return None
    base = Path(value)
    if not base.is_dir():
        log.info("memory tier off: %s is not a directory", base)
        return None
    try:
        gone = sweep(base, PREFIX)
        if gone:
            log.info("removed %d memory-tier directories of launchers that are gone, under %s", len(gone), base)
        key = re.sub(r"[^A-Za-z0-9_.-]", "_", job_key)[:80]
        tag = owner_tag()
        return Path(tempfile.mkdtemp(prefix=f"{PREFIX}{key}.n{node}-{tag + '-' if tag else ''}", dir=base))
    except OSError as exc:
        log.info("memory tier off: cannot make a directory under %s (%s)", base, exc.strerror or exc)
        return None


def view(path: Path | None) -> dict[str, Any] | None:
    """The launcher, for `status` (published with the hang watch's summary every few seconds): the
    memory root's newest committed step, the bytes it holds (its snapshots and the replicas of
    other nodes' it keeps, job/peercopy.py) and, per node whose replica it holds, that replica's
    step. None without a memory root. Never raises."""
    if path is None:
        return None
    from ..checkpoint.store import newest_committed

    held = 0
    replicas: dict[str, int | None] = {}
    try:
        for entry in os.scandir(path):
            if entry.name == PEERS and entry.is_dir(follow_symlinks=False):
                for node in os.scandir(entry.path):
                    held += _held(node.path)
                    replicas[node.name.removeprefix("n")] = newest_committed(Path(node.path))
            else:
                held += _held(path, entry)
        return {"step": newest_committed(path), "bytes": held, **({"replicas": replicas} if replicas else {})}
    except OSError:
        return {"step": None, "bytes": held}


def _held(path: Path | str, entry: os.DirEntry[str] | None = None) -> int:
    """The bytes of the files one step directory deep (`entry`: that one directory only)."""
    total = 0
    for d in [entry] if entry is not None else list(os.scandir(path)):
        if d.is_dir(follow_symlinks=False):
            total += sum(f.stat(follow_symlinks=False).st_size for f in os.scandir(d.path)
                         if f.is_file(follow_symlinks=False))
    return total


def remove(path: Path | None) -> None:
    """The launcher, when the job ends on this node or is requeued: the snapshots are freed. Never raises."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)

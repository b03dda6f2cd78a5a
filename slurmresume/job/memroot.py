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

from .hbsweep import owner_tag, sweep

log = logging.getLogger("slurmresume")

PREFIX = "slurmresume-mem-"
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


def view(path: Path | None) -> dict[str, int | None] | None:
    """The launcher, for `status` (published with the hang watch's summary every few seconds): the
    memory root's newest committed step and the bytes it holds (every snapshot in it, one level
    deep). None without a memory root. Never raises."""
    if path is None:
        return None
    from ..checkpoint.store import newest_committed

    held = 0
    try:
        for entry in os.scandir(path):
            if entry.is_dir(follow_symlinks=False):
                for f in os.scandir(entry.path):
                    if f.is_file(follow_symlinks=False):
                        held += f.stat(follow_symlinks=False).st_size
        return {"step": newest_committed(path), "bytes": held}
    except OSError:
        return {"step": None, "bytes": held}


def remove(path: Path | None) -> None:
    """The launcher, when the job ends on this node or is requeued: the snapshots are freed. Never raises."""
    if path is not None:
        shutil.rmtree(path, ignore_errors=True)

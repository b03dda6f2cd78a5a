"""Several nodes: how one node's ranks learn that a rank on another node died without warning, for
the failure-time save (train/failsave.py; DESIGN.md section 10).

A node's ranks see their own peers die (pidfds, train/peers.py), never another node's. So the
survivors of the node where a rank died post `dead-<rank>.json` in the run's shared directory
(`<root>/.runs/failsave/<run id>/`, on the checkpoint root every node mounts, passed to the ranks
as $SLURMRESUME_FAILSAVE_SHARED), and that is also where all survivors then meet (statuses, the
snapshots they copy out, the writers' decisions and reports). Each node's launcher lists that
directory every SCAN_S while its torchrun runs; on the first notice it writes one byte into a
FIFO in its node-local failsave directory, which every rank of the node waits on beside its
peers' pidfds (readable: a death elsewhere). A FIFO whose bytes nobody reads stays readable for
every reader, so one write reaches all ranks.

Cost on the shared file system: one directory listing per node every SCAN_S (nothing per rank,
nothing per step). Positive evidence only (DESIGN.md section 8): a notice is posted by a node that
saw the rank's process exit; nothing here infers a death from silence.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from ..contract import (
    ENV_FAILSAVE_SHARED,
    FAILSAVE_DEAD_PREFIX,
    FAILSAVE_NOTICE,
    FAILSAVE_SUBDIR,
    RUNS_DIR,
)

SCAN_S = 0.5  # how often a launcher lists the shared directory while its run lasts
KEEP_S = 300.0  # another run's shared directory untouched for this long is removed (its survivors are long gone)


def shared_dir(root: Path, run_id: str) -> Path:
    return Path(root) / RUNS_DIR / FAILSAVE_SUBDIR / run_id


class DeathBoard:
    """One run, one node: the shared directory (made here) and this node's FIFO."""

    def __init__(self, root: Path, run_id: str, local_dir: Path) -> None:
        self.dir = shared_dir(root, run_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        failsave = local_dir / FAILSAVE_SUBDIR
        failsave.mkdir(mode=0o700, exist_ok=True)
        path = failsave / FAILSAVE_NOTICE
        os.mkfifo(path, 0o600)
        # read-write: opening never blocks, and the FIFO always has a writer (this launcher)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._next = 0.0
        self.noticed = False

    def env(self) -> dict[str, str]:
        return {ENV_FAILSAVE_SHARED: str(self.dir)}

    def poll(self, now: float) -> bool:
        """At most every SCAN_S: a death posted by any node? The first one wakes this node's ranks."""
        if self.noticed or now < self._next:
            return self.noticed
        self._next = now + SCAN_S
        try:
            names = os.listdir(self.dir)
        except OSError:
            return False
        if any(n.startswith(FAILSAVE_DEAD_PREFIX) and n.endswith(".json") for n in names):
            self.noticed = True
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.write(self._fd, b"!")
        return self.noticed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def sweep(root: Path, keep: str, now: float | None = None) -> list[str]:
    """The first node, at each run's start: remove other runs' shared directories that nothing has
    touched for KEEP_S (a straggling survivor of the previous run may still be writing in its own)."""
    base = Path(root) / RUNS_DIR / FAILSAVE_SUBDIR
    now = time.time() if now is None else now
    gone: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return gone
    for entry in entries:
        if entry.name == keep or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            newest = max([entry.stat().st_mtime, *(e.stat().st_mtime for e in os.scandir(entry.path))])
        except OSError:
            continue
        if now - newest > KEEP_S:
            shutil.rmtree(entry.path, ignore_errors=True)
            gone.append(entry.name)
    return gone

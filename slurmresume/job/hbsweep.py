"""Heartbeat directories whose launcher is gone: named after their owner, swept by the next one.

A launcher removes its heartbeat directory when it ends (HangWatch.close), but one that is
SIGKILLed (Slurm's KillWait after a preemption's grace period, the OOM killer, `scancel -s
KILL`) cannot: on a long-lived node /dev/shm (RAM) then keeps one directory, with its ranks'
record and stacks files, per such run. So the directory's name says who owns it
(`owner_tag`: pid, that process's start time, its pid namespace and this boot of this host), and every launcher, before
it makes its own, removes the directories of owners that are provably gone (`sweep`).

Provably gone, and nothing else (do no harm: a live run's directory is never touched):
- the name carries this module's tag (a directory of an older version, or any other name, is
  left alone: nothing says whose it is);
- it was made during this boot of this host (a $TMPDIR shared between nodes holds other hosts'
  pids) and in this pid namespace (another container sharing the directory sees other pids);
- no process has that pid now, or the one that has it started at another time (pid reused);
- it is a real directory (not a link) owned by this user.
Decisions are `stale` (pure); `sweep` reads /proc and removes.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path

from ..identity import boot_id, pid_namespace, start_ticks

PREFIX = "slurmresume-hb-"
_TAG = re.compile(r"-o(\d+)\.(\d+)\.(\d+)\.([0-9a-f]{12})-[^-]*\Z")  # -o<pid>.<start>.<pid ns>.<boot>-<random>


def owner_tag() -> str | None:
    """"o<pid>.<start time in clock ticks>.<pid namespace inode>.<boot>" of this process, None
    where /proc cannot say (then the directory is made untagged and never swept)."""
    pid = os.getpid()
    start, where = start_ticks(pid), namespace_and_boot()
    return None if start is None or where is None else f"o{pid}.{start}.{where[0]}.{where[1]}"


def namespace_and_boot() -> tuple[int, str] | None:
    """(this process's pid namespace inode, the first 12 hex digits of this boot's id): the init
    namespace has the same inode on every host, the boot id tells hosts (and boots) apart."""
    namespace, boot = pid_namespace(), boot_id().replace("-", "")[:12]
    return (namespace, boot) if namespace and boot else None


def stale(name: str, here: tuple[int, str] | None, start_of: Callable[[int], int | None],
          prefix: str = PREFIX) -> bool:
    """Pure: whether directory `name` belongs to a launcher that is gone. `here`: this process's
    `namespace_and_boot`; `start_of(pid)`: that pid's current start time, None when no process has
    it; `prefix`: the kind of directory (heartbeats, or the memory tier's: job/memroot.py)."""
    if not name.startswith(prefix) or here is None:
        return False
    tag = _TAG.search(name)
    if tag is None:
        return False
    pid, start, namespace, boot = int(tag[1]), int(tag[2]), int(tag[3]), tag[4]
    if (namespace, boot) != here:
        return False
    return start_of(pid) != start


def sweep(base: Path, prefix: str = PREFIX) -> list[str]:
    """Remove the directories named `prefix`... in `base` whose owner is gone; returns their names.
    Never raises: a directory that cannot be listed or removed is left as it is."""
    here = namespace_and_boot()
    if here is None:
        return []
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix)]
    except OSError:
        return []
    removed = []
    uid = os.getuid()
    for name in names:
        if not stale(name, here, start_ticks, prefix):
            continue
        path = Path(base) / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not (stat.S_ISDIR(st.st_mode) and st.st_uid == uid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append(name)
    return removed

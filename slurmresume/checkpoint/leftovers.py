"""Directories a killed writer left in a root: a save's `.saving.step_N.<token>/` and a mirror
download's `.mirror-download.step_N.<pid>.<hex>/`. Both hold the bytes written so far (on a full
disk, the next saves fail because of them) and nothing reads them.

Removed (`clean`: by the run that owns the root before each save and before each pull from the
mirror, and by `prune`) only when
both hold: the writer is provably dead (its `.inprogress` note names a process of this boot and
this pid namespace that has exited, or whose pid now names a process started at another time:
identity.py) and nothing in it changed for `young_s` seconds. A writer in another container
(another pid namespace), on another host or boot, or named by a note without these fields (an
older version's) is never provably dead from here. Everything else is
kept and listed by `status` with its size (`listing`). `plan` decides; `clean` acts.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from .. import identity
from .fsio import remove_tree
from .layout import INPROGRESS, SAVING_PREFIX

log = logging.getLogger("slurmresume")

DOWNLOAD_PREFIX = ".mirror-download."  # mirror/transfer.py names its downloads so
PREFIXES = (SAVING_PREFIX, DOWNLOAD_PREFIX)


@dataclass(frozen=True)
class Leftover:
    name: str
    last_activity: float  # newest mtime of the directory and its entries
    writer_dead: bool  # provably: see `writer_dead`


def plan(found: list[Leftover], now: float, young_s: float) -> list[str]:
    """Pure: the names to remove (writer provably dead and idle for `young_s`)."""
    return sorted(f.name for f in found if f.writer_dead and now - f.last_activity >= young_s)


def note(pid: int | None = None) -> bytes:
    """The `.inprogress` note a writer leaves in its private directory: who (identity.py: host,
    boot, pid namespace, pid and its start time), since when. `pid`: another process of this pid
    namespace (default: the caller)."""
    who = identity.this_process() if pid is None else identity.of_pid(pid)
    return json.dumps({**who.record(), "started": time.time()}, separators=(",", ":")).encode()


def writer_dead(directory: Path) -> bool:
    """True only on proof: the note names a process of this boot and pid namespace that no longer
    runs (or whose pid a later process has). No note, a hostile one, another host, boot or
    container, a note without those fields: False (it may still run)."""
    try:
        fd = os.open(directory / INPROGRESS, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            writer = identity.ProcessId.from_record(json.loads(os.read(fd, 4096)))
        finally:
            os.close(fd)
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return False
    here = identity.this_process()
    seen = identity.look(writer.pid) if identity.comparable(writer, here) else None
    return identity.judge(writer, here, seen) == identity.GONE


def find(root: Path, prefixes: tuple[str, ...] = PREFIXES) -> list[Leftover]:
    try:
        with os.scandir(root) as it:
            dirs = [Path(e.path) for e in it if e.name.startswith(prefixes) and e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    return [Leftover(d.name, last_activity(d), writer_dead(d)) for d in dirs]


def clean(root: Path, young_s: float, now: float | None = None, prefixes: tuple[str, ...] = PREFIXES) -> list[str]:
    """Remove what `plan` names (of the directories named `prefixes`*); best effort (never
    raises). Returns the names this call removed, entirely (`fsio.remove_tree`)."""
    removed = []
    for name in plan(find(Path(root), prefixes), time.time() if now is None else now, young_s):
        if remove_tree(Path(root) / name):  # not one that failed, vanished or another cleaner took
            removed.append(name)
            log.info("removed %s: left by a killed writer", Path(root) / name)
    return removed


def listing(root: Path) -> list[tuple[str, int]]:
    """(name, bytes) of every leftover directory still in `root` (for `status`)."""
    out = []
    for f in find(Path(root)):
        total = 0
        try:
            with os.scandir(Path(root) / f.name) as it:
                total = sum(e.stat(follow_symlinks=False).st_size for e in it)
        except OSError:
            pass
        out.append((f.name, total))
    return sorted(out)


def last_activity(path: Path) -> float:
    """The newest mtime of `path` and, for a directory (not a link to one), its entries; now when
    unreadable (fresh, never old)."""
    try:
        st = path.lstat()
        newest = st.st_mtime
        if not stat.S_ISDIR(st.st_mode):
            return newest
        with os.scandir(path) as it:
            for e in it:
                newest = max(newest, e.stat(follow_symlinks=False).st_mtime)
    except OSError:
        return time.time()  # unreadable or vanished: fresh, never old
    return newest

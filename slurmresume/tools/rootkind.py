"""What a directory given as a checkpoint root really is: `status` on a drill's folder or on a
step folder must say so, not answer STARTING for a root that has no run.

A root is a directory holding the event log or step_* folders, or an empty one (a run that has
not started yet). `misplaced_root` reads names only (no manifest, no marker). A directory holding
only what slurmresume itself writes before the first event (the lease, the lock, `submit`'s
logs/ folder) is a root too; any other one (a home or scratch folder) is not.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from ..checkpoint.layout import (
    DELETING_PREFIX,
    EVENTS,
    LOCK,
    OWNER,
    OWNER_LOCK,
    REPLACED_PREFIX,
    SAVING_PREFIX,
    parse_step_dir,
)
from ..contract import RUNS_DIR

_SCAN_LIMIT = 1000  # entries looked at: a huge directory is judged on its first ones


def _looks_like_root(path: Path) -> bool:
    try:
        with os.scandir(path) as it:
            for i, entry in enumerate(it):
                if i >= _SCAN_LIMIT:
                    break
                if entry.name == EVENTS or (parse_step_dir(entry.name) is not None and entry.is_dir()):
                    return True
    except OSError:
        return False
    return False


# What a run writes in its root besides the event log and step folders, before either exists:
# `submit` creates logs/ and the lease; the launcher its run records; a save its lock and
# temporary folders.
_OURS = {"logs", OWNER, OWNER_LOCK, LOCK, RUNS_DIR}
_OUR_PREFIXES = (SAVING_PREFIX, DELETING_PREFIX, REPLACED_PREFIX)


def _only_ours(path: Path) -> bool:
    """The directory is empty or holds only names a run writes before its first event."""
    try:
        with os.scandir(path) as it:
            for i, entry in enumerate(it):
                if i >= _SCAN_LIMIT:
                    return False
                if entry.name not in _OURS and not entry.name.startswith(_OUR_PREFIXES):
                    return False
    except OSError:
        return True  # unreadable: judged by whoever reads it next, not guessed here
    return True


def misplaced_root(path: Path, command: str = "status") -> str | None:
    """One line when `path` is not a checkpoint root but a step folder (point at its parent) or a
    folder of roots such as a drill's (point at each); None when it is a root, or may become one."""
    step = parse_step_dir(path.name)
    if step is not None and ((path / "manifest.json").exists() or _looks_like_root(path.parent)):
        return (f"{path} is a step folder, not a checkpoint root: use its parent: "
                f"slurmresume {command} -d {shlex.quote(str(path.parent))}")
    if _looks_like_root(path):
        return None
    try:
        children = sorted(e.path for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))
    except OSError:
        return None
    roots = [Path(c) for c in children[:_SCAN_LIMIT] if _looks_like_root(Path(c))]
    if not roots:
        if _only_ours(path):
            return None
        return (f"{path} is not a checkpoint root (no step_* folder, no {EVENTS}): give the run's --ckpt-dir, "
                f"e.g. slurmresume {command} -d RUN_DIR")
    shown = " or ".join(f"slurmresume {command} -d {shlex.quote(str(r))}" for r in roots[:3])
    more = f" (and {len(roots) - 3} more)" if len(roots) > 3 else ""
    return f"{path} is not a checkpoint root but holds {len(roots)}: {shown}{more}"

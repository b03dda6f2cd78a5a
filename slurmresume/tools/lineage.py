"""Going back to an older committed step without silently overwriting newer ones.

`submit --resume-from S` when steps newer than S exist needs a decision:
  --branch NEW_ROOT   a new root starts from S (hard links: committed files are never modified,
                      so the old root stays byte-identical); its event log records the parent
  --discard-newer     the newer steps go, through the same crash-safe deletion as `prune`
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..checkpoint.commit import move_aside, root_lock
from ..checkpoint.fsio import makedirs
from ..checkpoint.layout import parse_step_dir, step_dir_name, step_dirs
from ..checkpoint.store import inspect_dir
from ..errors import ConfigError
from ..events import EV_BRANCHED, EV_DISCARDED_NEWER, append_event


def parse_resume_from(value: str, root: Path) -> tuple[Path, int]:
    """STEP (under root) or a path to a step directory -> (root, step)."""
    if value.isdigit():
        return root, int(value)
    path = Path(value).expanduser().absolute()
    step = parse_step_dir(path.name)
    if step is None:
        raise ConfigError(f"--resume-from {value!r} is neither a step number nor a step_NNNNNNNNN directory")
    return path.parent, step


def prepare_resume(root: Path, resume_from: str, *, branch: Path | None, discard_newer: bool) -> Path:
    """Make the run start from the chosen step; returns the checkpoint root the run must use."""
    if branch is not None and discard_newer:
        raise ConfigError("--branch and --discard-newer exclude each other: choose one")
    src_root, step = parse_resume_from(resume_from, root)
    info = inspect_dir(step, src_root / step_dir_name(step))
    if not info.complete:
        raise ConfigError(f"cannot resume from {info.path}: {info.problem}")
    newer = [s for s, _ in step_dirs(src_root) if s > step]
    if branch is not None:
        return _branch(src_root, step, branch.expanduser().absolute())
    if not newer:
        return src_root
    if not discard_newer:
        raise ConfigError(f"{src_root} has {len(newer)} step(s) newer than {step} (newest {max(newer)}): "
                          f"pass --branch NEW_ROOT to start a new root from step {step}, or --discard-newer "
                          "to delete the newer steps")
    with root_lock(src_root):
        for s in sorted(newer, reverse=True):
            move_aside(src_root / step_dir_name(s), "discard")
    append_event(src_root, EV_DISCARDED_NEWER, step=step, removed=sorted(newer))
    return src_root


def _branch(src_root: Path, step: int, new_root: Path) -> Path:
    if new_root == src_root:
        raise ConfigError("--branch must name a new checkpoint root, not the current one")
    if new_root.exists() and any(new_root.iterdir()):
        raise ConfigError(f"--branch {new_root} exists and is not empty: choose a new directory")
    makedirs(new_root)
    src, dst = src_root / step_dir_name(step), new_root / step_dir_name(step)
    tmp = new_root / f".branching.{step_dir_name(step)}"
    tmp.mkdir(mode=0o755)
    for f in src.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:  # another file system: copy
            shutil.copy2(f, tmp / f.name)
    os.replace(tmp, dst)  # the committed step appears whole, marker included, in one rename
    append_event(new_root, EV_BRANCHED, parent_root=str(src_root), parent_step=step)
    return new_root

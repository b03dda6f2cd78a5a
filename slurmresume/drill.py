"""`slurmresume drill`: prove a script resumes exactly, before spending cluster hours.

Runs the script once uninterrupted and once with N warning signals injected at seeded random
steps (through the real launcher, torchrun and signal relay, in local mode), then compares the
final checkpoints of both runs tensor by tensor and value by value.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

from .checkpoint.store import find_latest
from .compare import Difference, compare_checkpoints
from .config import JobSpec
from .errors import CheckpointError, ConfigError
from .events import read_events
from .node import run_local

# The drill marks the directories it creates, and deletes only the two run roots inside a marked
# one: a --workdir the user pointed at their own files is refused, never wiped.
WORKDIR_MARK = ".slurmresume-drill"
RUN_DIRS = ("uninterrupted", "preempted")


@dataclass
class DrillReport:
    steps: int
    planned: list[int]
    preemptions: int  # warnings that ended in a committed save and a restart
    saved_steps: list[int]
    reference: Path
    resumed: Path
    differences: list[Difference] = field(default_factory=list)

    @property
    def missed(self) -> int:
        """Planned warnings that did not end in a save and a restart (the proof is weaker)."""
        return max(0, len(self.planned) - self.preemptions)

    @property
    def ok(self) -> bool:
        return not self.differences and self.preemptions > 0 and self.missed == 0


def pick_steps(total: int, n: int, seed: int) -> list[int]:
    """n distinct steps in [1, total-1], reproducible from the seed."""
    if total < 2:
        return []
    return sorted(random.Random(seed).sample(range(1, total), min(n, total - 1)))


def run_drill(spec: JobSpec, *, preemptions: int, seed: int, workdir: Path,
              ignore_keys: tuple[str, ...] = ()) -> DrillReport:
    """Both runs under `workdir` (see `prepare_workdir`). Raises CheckpointError when a run
    leaves no final checkpoint (the script must save at its end)."""
    prepare_workdir(workdir)
    ref_root, drill_root = (workdir / name for name in RUN_DIRS)
    run_local(replace(spec, ckpt_dir=ref_root, max_requeues=preemptions + 2, max_failures=0))
    ref = find_latest(ref_root, warn=False)
    if ref is None:
        raise CheckpointError(f"the uninterrupted run left no complete checkpoint in {ref_root}: "
                              "save at the end of training (ckpt.save(step, state))")
    planned = pick_steps(ref.step, preemptions, seed)
    run_local(replace(spec, ckpt_dir=drill_root, max_requeues=preemptions + 2, max_failures=0),
              env={"SLURMRESUME_DRILL_AT": ",".join(map(str, planned))})
    final = find_latest(drill_root, warn=False)
    if final is None:
        raise CheckpointError(f"the preempted run left no complete checkpoint in {drill_root}")
    events = read_events(drill_root)
    saved = [e["step"] for e in events if e["event"] == "exit_after_save" and e.get("kind") == "preempt"]
    restarts = sum(1 for e in events if e["event"] == "requeued")
    report = DrillReport(ref.step, planned, restarts, saved, ref.path, final.path)
    if final.step != ref.step:
        report.differences = [Difference(0, "step", f"uninterrupted run ended at step {ref.step}, "
                                                    f"preempted run at {final.step}")]
    else:
        report.differences = compare_checkpoints(ref.path, final.path, ignore_keys)
    return report


def prepare_workdir(workdir: Path) -> None:
    """Make `workdir` ready for a drill without deleting anything the drill did not create.

    A missing or empty directory is created and marked; a directory marked by an earlier drill
    loses only its two run roots (`uninterrupted/`, `preempted/`); anything else (a non-empty
    directory without the mark, a file) is refused with ConfigError before anything changes."""
    if workdir.is_symlink() or (workdir.exists() and not workdir.is_dir()):
        raise ConfigError(f"--workdir {workdir} is not a directory: choose a new directory for the drill")
    if workdir.is_dir():
        marked = (workdir / WORKDIR_MARK).is_file()
        if not marked and any(os.scandir(workdir)):
            raise ConfigError(f"--workdir {workdir} is not empty and was not created by a drill: refusing to "
                              "delete its contents; choose a new or empty directory")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / WORKDIR_MARK).write_text("created by `slurmresume drill`; its run directories are replaced "
                                        "by the next drill in this directory\n")
    for name in RUN_DIRS:
        path = workdir / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)

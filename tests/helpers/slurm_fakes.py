"""Fake Slurm client commands on PATH, for tests of command construction (no cluster): a
`sbatch` that accepts every job, `srun` (submitit looks for it) and, when asked, a `scontrol`
answering `show partition` with the given text."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# `scontrol show partition` of a small cluster: the default partition `cpu` with a 1 h MaxTime,
# `long` without a limit.
PARTITIONS = (
    "PartitionName=cpu AllowGroups=ALL Default=YES MaxTime=01:00:00 DefaultTime=00:30:00 PriorityTier=1 "
    "GraceTime=0 State=UP\n\n"
    "PartitionName=long AllowGroups=ALL Default=NO MaxTime=UNLIMITED PriorityTier=1 GraceTime=0 State=UP\n"
)


def fake_slurm(tmp: Path, *, srun: bool = True, partitions: str | None = None) -> Path:
    """bash, env and python, a `sbatch` that accepts every job (and `srun` unless told not);
    with `partitions`, a `scontrol` whose `show partition` prints that text."""
    d = tmp / "bin"
    d.mkdir()
    for name in ("bash", "env", "sh", "cat", "uname"):
        found = shutil.which(name)
        if found:
            os.symlink(found, d / name)
    (d / "sbatch").write_text("#!/bin/sh\necho 'Submitted batch job 4242'\n")
    (d / "sbatch").chmod(0o755)
    if srun:
        (d / "srun").write_text("#!/bin/sh\nexit 0\n")
        (d / "srun").chmod(0o755)
    if partitions is not None:
        (d / "partitions.txt").write_text(partitions)
        (d / "scontrol").write_text(f"#!/bin/sh\n[ \"$1 $2\" = 'show partition' ] && exec cat {d / 'partitions.txt'}\n"
                                    "exit 1\n")
        (d / "scontrol").chmod(0o755)
    return d

"""Is the test cluster up? One answer for every real-Slurm module.

`sinfo -h -o %T` prints one state per node group. While the other Slurm chain's job is
being requeued or ending, the node reads `completing` (or carries a flag suffix such as
`mixed+`/`idle*`) for a few seconds; that is a working cluster, not a down one. A node
that is `down`/`drained`/`unknown`, or a controller that does not answer, is retried for
`patience` seconds before the answer is no.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time

WORKING = {"idle", "mixed", "allocated", "completing", "planned", "reserved"}


def node_states(out: str) -> set[str]:
    """Base state names from `sinfo -h -o %T` output (`mixed+` → `mixed`, `idle*` → `idle`)."""
    return {re.sub(r"[^a-z_]", "", word.lower()) for word in out.split()} - {""}


def cluster_up(patience: float = 60.0, every: float = 1.0) -> tuple[bool, str]:
    """(up, what sinfo said last): up once any node is in a working state."""
    if shutil.which("sinfo") is None:
        return False, "no sinfo on PATH"
    deadline = time.monotonic() + patience
    while True:
        probe = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
        said = (probe.stdout + probe.stderr).strip()
        if probe.returncode == 0 and WORKING & node_states(probe.stdout):
            return True, said
        if time.monotonic() >= deadline:
            return False, said
        time.sleep(every)


def node_count() -> int:
    """How many nodes the cluster has (`sinfo -N` lists a node once per partition), 0 if sinfo fails."""
    probe = subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True)
    return len(set(probe.stdout.split())) if probe.returncode == 0 else 0

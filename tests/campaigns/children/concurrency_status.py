"""Concurrency campaign, the status reader: status.compute_status and find_latest in a loop
until STOP exists (Slurm is not queried); one JSON line per snapshot in LOG: the newest complete
step, the latest, the checkpoints called corrupt and the problems, or a crash.

    python tests/campaigns/children/concurrency_status.py ROOT STOP LOG
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import slurmresume.tools.status as st
from slurmresume.checkpoint.store import find_latest


def _no_slurm(job_id: str | None) -> tuple[st.JobInfo, str | None]:
    return st.JobInfo(job_id), "campaign: Slurm not queried"


def main(argv: list[str]) -> int:
    st.query_job = _no_slurm
    root, stop = Path(argv[0]), Path(argv[1])
    with open(argv[2], "a") as log:
        while not stop.exists():
            t0 = time.time()
            try:
                s = st.compute_status(root, history_limit=0)
                latest = find_latest(root, warn=False)
                log.write(json.dumps({"t0": t0, "t1": time.time(), "newest": s.newest_complete,
                                      "latest": latest.step if latest else None,
                                      "corrupt": [(r.name, r.problem) for r in s.checkpoints if r.state == "corrupt"],
                                      "problems": s.problems}) + "\n")
            except Exception:
                log.write(json.dumps({"crash": traceback.format_exc()[-1500:]}) + "\n")
            log.flush()
            time.sleep(0.003)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

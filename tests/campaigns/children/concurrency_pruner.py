"""Concurrency campaign, the library pruner: retention.execute(keep=2,
remove_incomplete_older_than=0, young_threshold=0) in a loop until STOP exists (only the
.inprogress note and the lock protect the directory being written); one JSON line per prune in
LOG: what it deleted, its refusal (a CheckpointError), or a crash (any other exception).

    python tests/campaigns/children/concurrency_pruner.py ROOT STOP LOG
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

from slurmresume.errors import CheckpointError
from slurmresume.retention import RetentionPolicy, execute


def main(argv: list[str]) -> int:
    root, stop = Path(argv[0]), Path(argv[1])
    policy = RetentionPolicy(keep=2, remove_incomplete_older_than=0, young_threshold=0)
    with open(argv[2], "a") as log:
        while not stop.exists():
            t0 = time.time()
            try:
                r = execute(root, policy, lock_timeout=5)
                log.write(json.dumps({"deleted": r.deleted, "t0": t0, "t1": time.time()}) + "\n")
            except CheckpointError as exc:
                log.write(json.dumps({"refused": str(exc), "type": type(exc).__name__, "t0": t0,
                                      "t1": time.time()}) + "\n")
            except Exception:
                log.write(json.dumps({"crash": traceback.format_exc()[-1500:]}) + "\n")
            log.flush()
            time.sleep(0.003)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

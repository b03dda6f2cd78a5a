"""Concurrency campaign, the command-line pruner: `python -m slurmresume prune --keep 2 --yes`
(plan, then execute), one process after another until STOP exists; one JSON line per run in LOG
({"rc": exit code, "t0": start}), and the output of any run that exits above 1 in LOG.out.

    python tests/campaigns/children/concurrency_cli_pruner.py ROOT STOP LOG
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    root, stop, log = Path(argv[0]), Path(argv[1]), Path(argv[2])
    while not stop.exists():
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "slurmresume", "prune", "--keep", "2", "--yes", "--ckpt-dir",
                               str(root)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        with open(log, "a") as f:
            f.write(json.dumps({"rc": proc.returncode, "t0": t0}) + "\n")
        if proc.returncode > 1:
            with open(f"{log}.out", "a") as f:
                f.write(proc.stdout + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

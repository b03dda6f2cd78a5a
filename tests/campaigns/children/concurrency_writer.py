"""Concurrency campaign, the writer: Checkpointer.save of steps 1, 2, ... (a 4 MiB tensor, so
that saves take a while) until STOP exists; one JSON line per step in LOG: {"ok": step, ...}
when it committed, {"failed": step, "error": ...} on a SaveError.

    python tests/campaigns/children/concurrency_writer.py ROOT STOP LOG
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from helpers.core import tiny_state  # noqa: E402

from slurmresume import Checkpointer, SaveError  # noqa: E402


def main(argv: list[str]) -> int:
    root, stop = Path(argv[0]), Path(argv[1])
    with open(argv[2], "a") as log:
        ck = Checkpointer(root, handle_signals=False)
        step = 0
        while not stop.exists():
            step += 1
            state = {**tiny_state(step), "big": torch.full((1 << 20,), float(step))}
            t0 = time.time()
            try:
                ck.save(step, state, metrics={"loss": 1.0 / step})
                log.write(json.dumps({"ok": step, "t0": t0, "t1": time.time()}) + "\n")
            except SaveError as exc:
                log.write(json.dumps({"failed": step, "t0": t0, "t1": time.time(), "error": str(exc)}) + "\n")
            log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

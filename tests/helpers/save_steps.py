"""Test helper: save a tiny model at a few steps with `Checkpointer(root, handle_signals=False)`.

    python tests/helpers/save_steps.py ROOT STEP [STEP ...]

The weights saved at step s are `helpers.core.tiny_state(s)`, so a test can tell which step a
restore produced. The fault seam of slurmresume/checkpoint/fsio.py (SLURMRESUME_TEST_KILL_AT,
SLURMRESUME_TEST_FAIL_AT, SLURMRESUME_TEST_TRACE) is read from the environment at import time,
which is why this runs as a process of its own. Prints "saved N" after each committed step.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.core import tiny_state  # noqa: E402

from slurmresume import Checkpointer  # noqa: E402


def main(argv: list[str]) -> int:
    root, steps = argv[0], [int(s) for s in argv[1:]]
    ckpt = Checkpointer(root, handle_signals=False)
    for step in steps:
        ckpt.save(step, tiny_state(step), metrics={"step": step})
        print(f"saved {step}", flush=True)
    ckpt.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

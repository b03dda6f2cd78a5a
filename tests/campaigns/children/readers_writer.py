"""Racing-readers campaign, the writer: step after step until STOP exists, alternating
single-rank Checkpointer saves with a 4 MiB tensor (odd steps) and 3-rank saves
(helpers.core.save_as_world: three shards one after another, then the manifest and the marker;
even steps). With RETAIN=1, RetentionPolicy(keep=2) after each commit. Prints each step saved.

    python tests/campaigns/children/readers_writer.py ROOT STOP RETAIN
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from helpers.core import save_as_world, tiny_state  # noqa: E402

from slurmresume import Checkpointer, RetentionPolicy  # noqa: E402
from slurmresume.train.saving import apply_retention  # noqa: E402


def main(argv: list[str]) -> int:
    root, stop, retain = Path(argv[0]), Path(argv[1]), argv[2] == "1"
    ck = Checkpointer(root, handle_signals=False, retention=RetentionPolicy(keep=2) if retain else None)
    step = 0
    while not stop.exists():
        step += 1
        if step % 2:
            ck.save(step, {**tiny_state(step), "big": torch.full((1 << 20,), float(step))})
        else:
            save_as_world(root, step, 3)
            if retain:
                apply_retention(root, ck.retention)
        print(step, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

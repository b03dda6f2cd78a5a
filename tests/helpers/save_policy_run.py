"""Test helper for issue #13 item 5 (run as a process of its own: the fault seam is read at import).

    save_policy_run.py exit-inflight ROOT   async save at step 4 whose commit is slowed down, then
                                            the script ends WITHOUT ckpt.close()
    save_policy_run.py seconds-warn ROOT    (under torch.distributed.run) every_seconds=0.3,
                                            on_save_error="warn", 40 steps of ~0.05 s
"""

from __future__ import annotations

import sys
import time

import torch

import slurmresume
from slurmresume.checkpoint import commit as _commit


def main(argv: list[str]) -> int:
    mode, root = argv[0], argv[1]
    state = {"w": torch.zeros(1000)}
    if mode == "exit-inflight":
        real = _commit.commit

        def slow_commit(*a, **k):  # type: ignore[no-untyped-def]
            time.sleep(1.5)  # the script's end comes while this save is being written
            return real(*a, **k)

        _commit.commit = slow_commit
        ck = slurmresume.Checkpointer(root, save_every=2, async_save=True, handle_signals=False)
        for step in range(1, 5):
            state["w"] += 1
            ck.step(step, state)
        print("script ends", flush=True)
        return 0  # no ck.close()
    import torch.distributed as dist

    dist.init_process_group("gloo")
    ck = slurmresume.Checkpointer(root, save_policy=slurmresume.SavePolicy(every_seconds=0.3),
                                  on_save_error="warn", handle_signals=False)
    for step in range(1, 41):
        state["w"] += 1
        time.sleep(0.05)
        ck.step(step, state)
    ck.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

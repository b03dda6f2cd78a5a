"""examples/train.py with an unwarned death placed by the test: in the first run only (attempt 0
of restart 0), right after the optimizer step of training step $KILL_AT_STEP, rank $KILL_RANK
SIGKILLs itself while every other rank sleeps $SURVIVOR_SLEEP s before its ckpt.step(): the
survivors' tensors are then one optimizer step past their last boundary (a failure save must
never commit them as that boundary's)."""

import os
import runpy
import signal
import time
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

AT = int(os.environ["KILL_AT_STEP"])
RANK = int(os.environ["KILL_RANK"])
FIRST = os.environ.get("SLURMRESUME_RUN_ID", "").endswith(".0.0")


def after_step(optimizer, args, kwargs):
    p = optimizer.param_groups[0]["params"][0]
    if not FIRST or int(optimizer.state[p]["step"]) != AT:
        return
    if int(os.environ["RANK"]) == RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SURVIVOR_SLEEP", "3")))


register_optimizer_step_post_hook(after_step)
runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "train.py"), run_name="__main__")

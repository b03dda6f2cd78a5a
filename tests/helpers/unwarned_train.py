"""examples/train.py (or the script named by $UNWARNED_SCRIPT, e.g. helpers/sharded_train.py) with
an unwarned death placed by the test, in the first run only (attempt 0
of restart 0). Either:
  KILL_AT_STEP=k KILL_RANK=r: right after the optimizer step of training step k, rank r SIGKILLs
      itself while every other rank sleeps $SURVIVOR_SLEEP s before its ckpt.step(): the
      survivors' tensors are then one optimizer step past their last boundary (a failure save
      must never commit them as that boundary's);
  STOP_AFTER_STEP=k STOP_RANK=r (or STOP_NODE=n STOP_LOCAL_RANK=l): rank r stops itself (SIGSTOP)
      in the forward of step k+1, before its gradient all-reduce; the test then SIGKILLs its
      process tree. A moment the test chooses by step, not by wall-clock time: the verdict does
      not depend on the machine's load. With STOP_AFTER_MEMORY=1 it first waits (a hang guard of
      120 s) until the memory tier's snapshot of step k is committed ($SLURMRESUME_MEMORY_DIR,
      train/memtier.py): its background write is done, whatever the machine's load.
Also, with any of them: HOLD_AT_STEP=k HOLD_FILE=path: every rank, in the forward of step k+1,
waits (a hang guard of 300 s) until the test creates that file, once: the test lets training go
on only once what it waits for in the background happened (a replica landed), whatever the load."""

import os
import runpy
import signal
import time
from pathlib import Path

from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

FIRST = os.environ.get("SLURMRESUME_RUN_ID", "").endswith(".0.0")
RANK = int(os.environ.get("RANK", "0"))
optimizers = []
held = []  # HOLD_AT_STEP: held once


def done_steps() -> int:
    if not optimizers:
        return 0
    opt = optimizers[0]
    p = opt.param_groups[0]["params"][0]
    return int(opt.state[p]["step"]) if p in opt.state else 0


def after_step(optimizer, args, kwargs):
    if not optimizers:
        optimizers.append(optimizer)
    if not FIRST or "KILL_AT_STEP" not in os.environ or done_steps() != int(os.environ["KILL_AT_STEP"]):
        return
    if int(os.environ["KILL_RANK"]) == RANK:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("SURVIVOR_SLEEP", "3")))


def stops_here():
    """STOP_RANK=r (a global rank), or STOP_NODE=n STOP_LOCAL_RANK=l (a Slurm node's local rank,
    whatever rank the rendezvous gave it)."""
    if "STOP_NODE" in os.environ:
        return (os.environ.get("SLURM_NODEID"), os.environ.get("LOCAL_RANK")) == \
            (os.environ["STOP_NODE"], os.environ["STOP_LOCAL_RANK"])
    return int(os.environ["STOP_RANK"]) == RANK


def before_forward(module, args):
    if FIRST and "HOLD_AT_STEP" in os.environ and not held and done_steps() == int(os.environ["HOLD_AT_STEP"]):
        held.append(True)
        end = time.monotonic() + 300
        while not Path(os.environ["HOLD_FILE"]).exists() and time.monotonic() < end:
            time.sleep(0.01)
    if FIRST and "STOP_AFTER_STEP" in os.environ and done_steps() == int(os.environ["STOP_AFTER_STEP"]) \
            and stops_here():
        if os.environ.get("STOP_AFTER_MEMORY") == "1":
            marker = Path(os.environ["SLURMRESUME_MEMORY_DIR"]) / f"step_{done_steps():09d}" / "COMMITTED"
            end = time.monotonic() + 120
            while not marker.exists() and time.monotonic() < end:
                time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGSTOP)


if FIRST and "KILL_IN_SAVE" in os.environ and int(os.environ.get("KILL_SAVE_RANK", "-1")) == RANK:
    # KILL_IN_SAVE="label[:N]" KILL_SAVE_RANK=r: rank r alone is SIGKILLed at the N-th crossing of
    # that fault point of slurmresume/checkpoint/fsio.py (e.g. "fsync.shard:2": in the second save)
    os.environ["SLURMRESUME_TEST_KILL_AT"] = os.environ["KILL_IN_SAVE"]
register_optimizer_step_post_hook(after_step)
register_module_forward_pre_hook(before_forward)
runpy.run_path(os.environ.get("UNWARNED_SCRIPT") or str(Path(__file__).resolve().parents[2] / "examples" / "train.py"),
               run_name="__main__")

"""A minimal training loop for the signal tests: deterministic, slow enough to signal mid-run.

Writes its pid to $PIDDIR/rank<R>.pid and its progress to $PIDDIR/progress<R> (the last step).
Usage: sig_train.py STEPS [STEP_SLEEP] [NUM_WORKERS] [START_METHOD]
With a START_METHOD (fork, spawn, forkserver) the loader uses that multiprocessing context and no
worker_init_fn: the library alone must keep the workers alive when they get the warning.
Writes the DataLoader workers' pids to $PIDDIR/workers<R>-<pid>.
"""

import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import slurmresume


def main() -> None:  # guarded: spawned DataLoader workers import this file
    steps = int(sys.argv[1])
    sleep = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
    num_workers = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    start_method = sys.argv[4] if len(sys.argv) > 4 else None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    piddir = Path(os.environ.get("PIDDIR") or Path(os.environ["SLURMRESUME_CKPT_DIR"]) / "pids")
    piddir.mkdir(parents=True, exist_ok=True)
    (piddir / f"rank{rank}.pid").write_text(str(os.getpid()))

    torch.manual_seed(rank)
    random.seed(rank)
    np.random.seed(rank)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 8))
    sampler = slurmresume.ResumableSampler(data, shuffle=True, seed=0)
    ckpt = slurmresume.Checkpointer()
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler, num_workers=num_workers,
                                         worker_init_fn=None if start_method else slurmresume.ignore_in_worker,
                                         multiprocessing_context=start_method,
                                         generator=torch.Generator().manual_seed(0), persistent_workers=num_workers > 0)
    state = {"model": model, "opt": opt, "sampler": sampler}
    step = ckpt.restore(state)
    (piddir / f"start{rank}-{os.getpid()}").write_text(str(step))
    it = iter(loader)
    if num_workers:
        workers = [w.pid for w in it._workers]  # type: ignore[attr-defined]
        (piddir / f"workers{rank}-{os.getpid()}").write_text(" ".join(map(str, workers)))
    while step < steps:
        (x,) = next(it)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)
        opt.step()
        sampler.advance(len(x))
        step += 1
        (piddir / f"progress{rank}").write_text(str(step))
        time.sleep(sleep)
        ckpt.step(step, state)
    ckpt.save(step, state, reason="final")
    ckpt.close()


if __name__ == "__main__":
    main()

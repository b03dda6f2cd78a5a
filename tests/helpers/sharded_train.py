"""examples/train.py's loop on a sharded model (issue 47's FSDP2 and HSDP runs), CPU + gloo, under
torchrun or `slurmresume submit --local --nproc-per-node 4`:

    sharded_train.py --shape fsdp2 ...   fully_shard over a 1-D mesh of every rank: each rank holds
                                         its own piece of every parameter and optimizer state (no
                                         replica anywhere)
    sharded_train.py --shape hsdp ...    HSDP: a 2-D mesh (replicate=2, shard=W/2), fully_shard(mesh=...):
                                         the ranks at the same shard index hold the same pieces

Deterministic: seeded per rank (dropout differs per rank, as in data parallelism), the data is
generated from the seed and split by ResumableSampler; resumable with slurmresume.Checkpointer like
examples/train.py. The model is sized so that a rank's pieces (parameters + AdamW's two moments)
exceed what a failure-time snapshot publishes (stepsnap.PUBLISH_MAX_BYTES): only a survivor that
holds the same pieces in memory can stand in for a dead rank.
"""

import argparse
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import slurmresume

p = argparse.ArgumentParser()
p.add_argument("--shape", choices=["fsdp2", "hsdp"], default="fsdp2")
p.add_argument("--steps", type=int, default=30)
p.add_argument("--save-every", type=int, default=10)
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--hidden", type=int, default=4096)
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/sharded"))
args = p.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if args.shape == "hsdp":
    if world % 2:
        raise SystemExit(f"--shape hsdp needs an even number of ranks, got {world}")
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
else:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
random.seed(args.seed + rank)
np.random.seed(args.seed + rank)

# -- data: a synthetic regression task generated from the seed (the same on every rank) --
dim, n = 64, 1024
g = torch.Generator().manual_seed(args.seed)
inputs = torch.randn(n, dim, generator=g)
targets = torch.tanh(inputs @ torch.randn(dim, dim, generator=g))
dataset = TensorDataset(inputs, targets)
sampler = slurmresume.ResumableSampler(dataset, shuffle=True, seed=args.seed)
loader = DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True,
                    generator=torch.Generator().manual_seed(args.seed))

# -- model: the same initial weights on every rank, then sharded --
torch.manual_seed(args.seed)
model = nn.Sequential(nn.Linear(dim, args.hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(args.hidden, dim))
fully_shard(model, mesh=mesh)
torch.manual_seed(args.seed + rank)  # dropout differs per rank
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.05 * s))

ckpt = slurmresume.Checkpointer(args.ckpt_dir, save_every=args.save_every)
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
         "loss": float("nan")}
step = ckpt.restore(state)
if rank == 0:
    print(f"rank 0 of {world} ({args.shape}): starting at step {step}", flush=True)

while step < args.steps:
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        state["loss"] = loss.item()  # before optimizer.step(), as in examples/train.py
        optimizer.step()
        scheduler.step()
        sampler.advance(len(x))
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        ckpt.step(step, state, metrics={"loss": state["loss"]})
        if step >= args.steps:
            break
    else:
        sampler.set_epoch(sampler.epoch + 1)

ckpt.save(step, state, metrics={"loss": state["loss"]}, reason="final")
ckpt.close()
if rank == 0:
    print(f"done at step {step}, final loss {state['loss']:.6f}", flush=True)
dist.destroy_process_group()

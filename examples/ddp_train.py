"""Data-parallel training with DDP whose resume is bitwise on any number of ranks.

    torchrun --nproc-per-node 3 examples/ddp_train.py --steps 30
    slurmresume drill examples/ddp_train.py --nproc-per-node 3 --preemptions 2 -- --steps 30

Each rank trains on its own part of the data (ResumableSampler), so DDP really averages
different gradients. DDP rebuilds its gradient buckets after a process's first backward; the
Checkpointer finds the DDP wrapper of `state["model"]` and saves that layout by itself, so a
resumed process reduces exactly like the uninterrupted one (with 3+ ranks the all-reduce's
rounding depends on the layout). Nothing to add: the wrapper only has to exist before restore.
"""

import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import slurmresume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=30)
p.add_argument("--save-every", type=int, default=0, help="0: save only on the warning and at the end")
p.add_argument("--seed", type=int, default=0)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--bucket-cap-mb", type=float, default=0.05, help="small: several buckets on a small model")
p.add_argument("--no-ddp-buckets", action="store_true", help="turn the bucket layout off (tests: drifts)")
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/ddp"))
args = p.parse_args()

distributed = "RANK" in os.environ
if distributed:
    dist.init_process_group("gloo")
rank = dist.get_rank() if distributed else 0
torch.manual_seed(args.seed + rank)  # dropout differs per rank
random.seed(args.seed + rank)  # every stream the run may draw from is seeded
np.random.seed(args.seed + rank)
# Nondeterministic kernels are CUDA's (scatter/index adds, cuBLAS workspaces); on torch 2.13 this call
# also imports torch._inductor, ~3 s of CPU per process and per restart, so a CPU run skips it.
if torch.cuda.is_available():
    torch.use_deterministic_algorithms(True)

g = torch.Generator().manual_seed(args.seed)  # the same data set on every rank
x = torch.randn(4096, 32, generator=g)
y = (x @ torch.randn(32, 10, generator=g)).argmax(1)
dataset = TensorDataset(x, y)
sampler = slurmresume.ResumableSampler(dataset, shuffle=True, seed=args.seed)  # each rank its part
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    generator=torch.Generator().manual_seed(args.seed))  # iter() leaves the global RNG alone

torch.manual_seed(args.seed)  # the same initial weights on every rank
model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 128), nn.GELU(),
                      nn.Linear(128, 64), nn.GELU(), nn.Linear(64, 10))
torch.manual_seed(args.seed + rank)
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb) if distributed else model
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

ckpt = slurmresume.Checkpointer(args.ckpt_dir, save_every=args.save_every or None)
state = {"model": model, "optimizer": optimizer, "sampler": sampler}
if distributed and args.no_ddp_buckets:  # the control: the explicit override, switched off
    state["ddp_buckets"] = slurmresume.DDPBuckets(ddp, enabled=False)
step = ckpt.restore(state)

loss = torch.tensor(float("nan"))  # a run resumed at its last step trains no more
while step < args.steps:
    for xb, yb in loader:
        loss = F.cross_entropy(ddp(xb), yb)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        sampler.advance(len(xb))
        step += 1
        ckpt.step(step, state)
        if step >= args.steps:
            break
    else:
        sampler.set_epoch(sampler.epoch + 1)

ckpt.save(step, state, reason="final")
ckpt.close()
if rank == 0:
    print(f"done at step {step}, loss {loss.item():.6f}", flush=True)
if distributed:
    dist.destroy_process_group()

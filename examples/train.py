"""A small, real training script that survives preemption. Reads top to bottom.

    python examples/train.py --steps 200 --save-every 50                # one process
    torchrun --nproc-per-node 2 examples/train.py --steps 200           # two ranks, gloo on CPU
    slurmresume drill examples/train.py --preemptions 3 -- --steps 60   # prove it resumes exactly
    slurmresume drill examples/train.py --nproc-per-node 4 -- --steps 60  # DDP on 4 ranks: bitwise too

DDP needs no line of its own: the Checkpointer finds the wrapper of state["model"] (created before
restore) and keeps its gradient-bucket layout, which a 3+ rank resume needs to be bitwise.

The checkpoint root comes from --ckpt-dir or $SLURMRESUME_CKPT_DIR (set by `slurmresume submit`).
"""

import argparse
import math
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import slurmresume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--save-every", type=int, default=50)
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--num-workers", type=int, default=0)
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/example"))
p.add_argument("--async-save", action="store_true", help="periodic saves in the background")
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
args = p.parse_args()

# -- distributed setup: torchrun sets RANK/WORLD_SIZE; a plain `python` run is one process --
distributed = "RANK" in os.environ
if distributed:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
else:
    rank, world = 0, 1
device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
random.seed(args.seed + rank)
np.random.seed(args.seed + rank)
torch.manual_seed(args.seed + rank)  # dropout differs per rank, as in real data parallelism
# Nondeterministic kernels are CUDA's (scatter/index adds, cuBLAS workspaces); on torch 2.13 this call
# also imports torch._inductor, ~3 s of CPU per process and per restart, so a CPU run skips it.
if torch.cuda.is_available():
    torch.use_deterministic_algorithms(True, warn_only=True)

# -- data: a synthetic next-token task generated from the seed (same on every rank) --
vocab, ctx, n_seq = 64, 32, 2048
g = torch.Generator().manual_seed(args.seed)
seqs = (torch.arange(ctx + 1)[None, :] * torch.randint(1, 7, (n_seq, 1), generator=g)
        + torch.randint(0, vocab, (n_seq, 1), generator=g)) % vocab
dataset = TensorDataset(seqs[:, :-1], seqs[:, 1:])
sampler = slurmresume.ResumableSampler(dataset, shuffle=True, seed=args.seed)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    num_workers=args.num_workers, worker_init_fn=slurmresume.ignore_in_worker,
                    generator=torch.Generator().manual_seed(args.seed))  # keeps the global RNG untouched


# -- model: a tiny causal transformer with dropout --
class TinyGPT(nn.Module):
    def __init__(self, d=64, heads=4, layers=2, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied weights: stored once in the checkpoint

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        return self.head(self.blocks(self.tok(x) + self.pos, mask=mask, is_causal=True))


model = TinyGPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
warmup = max(1, args.steps // 10)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / max(1, args.steps))))
ddp = nn.parallel.DistributedDataParallel(model) if distributed else model

# -- slurmresume: everything needed to continue exactly (RNG states are added automatically) --
ckpt = slurmresume.Checkpointer(args.ckpt_dir, save_every=args.save_every, async_save=args.async_save)
state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "sampler": sampler,
         "loss": float("nan")}
step = ckpt.restore(state)
if rank == 0:
    print(f"rank 0 of {world}: starting at step {step} (checkpoints in {args.ckpt_dir})", flush=True)

# -- training loop --
while step < args.steps:
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(ddp(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        state["loss"] = loss.item()  # before optimizer.step(): a rank killed after it loses nothing
        optimizer.step()
        scheduler.step()
        sampler.advance(len(x))
        step += 1
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {state['loss']:.4f} lr {scheduler.get_last_lr()[0]:.2e}", flush=True)
        if args.step_sleep:
            time.sleep(args.step_sleep)  # tests widen the window in which a signal lands
        ckpt.step(step, state, metrics={"loss": state["loss"]})  # periodic save; signal -> save + exit
        if step >= args.steps:
            break
    else:
        sampler.set_epoch(sampler.epoch + 1)

ckpt.save(step, state, metrics={"loss": state["loss"]}, reason="final")
ckpt.close()
if rank == 0:
    print(f"done at step {step}, final loss {state['loss']:.4f}", flush=True)
if distributed:
    dist.destroy_process_group()

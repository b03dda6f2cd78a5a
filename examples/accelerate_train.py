"""A plain accelerate loop that survives preemption: `accelerator.prepare(...)` as usual, then a
`slurmresume.Checkpointer` over the *unwrapped* objects. Reads top to bottom.

    python examples/accelerate_train.py --steps 40                                 # one process
    torchrun --nproc-per-node 2 examples/accelerate_train.py --steps 40            # DDP on gloo
    slurmresume drill examples/accelerate_train.py --preemptions 2 -- --steps 24   # prove it resumes exactly

The checkpoint root comes from --ckpt-dir or $SLURMRESUME_CKPT_DIR (set by `slurmresume submit`).
"""

import argparse
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import slurmresume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--save-every", type=int, default=None)
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/accelerate"))
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
args = p.parse_args()

accelerator = Accelerator(cpu=True)  # sets up torch.distributed under torchrun
set_seed(args.seed + accelerator.process_index)  # random, numpy, torch; dropout differs per rank

# -- data: a synthetic next-token task; the sampler splits by rank and knows its position, so
#    the loader is NOT handed to accelerator.prepare (which would re-shard it) --
vocab, ctx, n_seq = 64, 32, 64
g = torch.Generator().manual_seed(args.seed)
seqs = (torch.arange(ctx + 1)[None, :] * torch.randint(1, 7, (n_seq, 1), generator=g)
        + torch.randint(0, vocab, (n_seq, 1), generator=g)) % vocab
dataset = TensorDataset(seqs[:, :-1], seqs[:, 1:])
sampler = slurmresume.ResumableSampler(dataset, shuffle=True, seed=args.seed)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    generator=torch.Generator().manual_seed(args.seed))


# -- model: a tiny causal transformer with dropout, AdamW, warm-up + cosine --
class TinyGPT(nn.Module):
    def __init__(self, d=32, heads=4, layers=2, dropout=0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        return self.head(self.blocks(self.tok(x) + self.pos, mask=mask, is_causal=True))


model = TinyGPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
warmup = max(1, args.steps // 10)
scheduler = torch.optim.lr_scheduler.LambdaLR(
    optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
model, optimizer = accelerator.prepare(model, optimizer)

# -- slurmresume: the unwrapped model, the optimizer, the scheduler and the data position --
ckpt = slurmresume.Checkpointer(args.ckpt_dir, save_every=args.save_every)
state = {"model": accelerator.unwrap_model(model), "optimizer": optimizer.optimizer, "scheduler": scheduler,
         "sampler": sampler}
step = ckpt.restore(state)

while step < args.steps:
    for x, y in loader:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        sampler.advance(len(x))
        step += 1
        if args.step_sleep:
            time.sleep(args.step_sleep)
        ckpt.step(step, state, metrics={"loss": loss.item()})  # periodic save; signal -> save + exit
        if step >= args.steps:
            break
    else:
        sampler.set_epoch(sampler.epoch + 1)

ckpt.save(step, state, reason="final")
ckpt.close()
if accelerator.is_main_process:
    print(f"done at step {step}", flush=True)

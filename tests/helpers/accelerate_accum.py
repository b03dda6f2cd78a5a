"""The accelerate recipe with gradient accumulation: `Accelerator(gradient_accumulation_steps=N)`
and `with accelerator.accumulate(model)`. Used by tests/test_accelerate_accumulation.py.

--placement recipe (the README's): every micro-batch trains and advances the sampler; only when
`accelerator.sync_gradients` (the optimizer really stepped) does the scheduler step, `step += 1`
and `ckpt.step()` run. So a save always lands between two optimizer steps, where nothing lives
outside the checkpoint (no accumulated gradient; accelerate's micro-batch counter is a multiple
of N and starts at 0 again after the restart, as it should).

--placement naive: `step += 1` and `ckpt.step()` after every micro-batch, as in the plain loop.
A warning between two micro-batches of one optimizer step saves without the gradient accumulated
so far, and the restarted accelerator counts its N micro-batches from there: a different grouping.
"""

import argparse
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset

import slurmresume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12, help="optimizer steps (naive: micro-batches)")
p.add_argument("--accum", type=int, default=3)
p.add_argument("--placement", choices=("recipe", "naive"), default="recipe")
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/accelerate-accum"))
args = p.parse_args()

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.accum)
set_seed(args.seed + accelerator.process_index)

# 40 samples: with 4 per batch per rank an epoch is not a multiple of the accumulation, so an
# accumulation window straddles the epoch's end
g = torch.Generator().manual_seed(args.seed)
xs = torch.randn(40, 8, generator=g)
ys = torch.randn(40, 1, generator=g)
dataset = TensorDataset(xs, ys)
sampler = slurmresume.ResumableSampler(dataset, shuffle=True, seed=args.seed)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    generator=torch.Generator().manual_seed(args.seed))  # not the global RNG

model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.9)  # NOT prepared
model, optimizer = accelerator.prepare(model, optimizer)

ckpt = slurmresume.Checkpointer(args.ckpt_dir)
state = {"model": accelerator.unwrap_model(model), "optimizer": optimizer.optimizer, "scheduler": scheduler,
         "sampler": sampler}
step = ckpt.restore(state)

while step < args.steps:
    for x, y in loader:
        with accelerator.accumulate(model):
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()       # a no-op until the N-th micro-batch
            optimizer.zero_grad()  # likewise
        sampler.advance(len(x))    # every micro-batch: the data position
        if args.placement == "naive" or accelerator.sync_gradients:
            if accelerator.sync_gradients:
                scheduler.step()
            step += 1
            ckpt.step(step, state, metrics={"loss": loss.item()})
        if step >= args.steps:
            break
    else:
        sampler.set_epoch(sampler.epoch + 1)

ckpt.save(step, state, reason="final")
ckpt.close()

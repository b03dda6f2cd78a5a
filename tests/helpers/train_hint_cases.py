"""A tiny script that follows the README recipe except for exactly one point (issue #28's hint
table: tests/test_drill_hints.py checks that the drill's first FAIL line names that point).

    train_hint_cases.py --steps N --case CASE

    ok            the recipe complete: passes
    wrong-start   restores, but counts its steps from 0 again (not from the step restore() returned)
    no-advance    a ResumableSampler in state that the loop never advances: each resume starts the
                  epoch over
    own-gen       draws its data noise from a torch.Generator that is not in state
    no-rng        restore(state, restore_rng=False): the global torch stream (dropout) is not put back
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

import slurmresume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--case", default="ok")
args = p.parse_args()

torch.manual_seed(0)
data = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
sampler = slurmresume.ResumableSampler(data, seed=0)
loader = DataLoader(data, batch_size=4, sampler=sampler, generator=torch.Generator().manual_seed(0))
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
noise = torch.Generator().manual_seed(5)
state = {"model": model, "optimizer": opt, "sampler": sampler, "epoch": 0}
if args.case == "ok":
    state["noise"] = noise
ckpt = slurmresume.Checkpointer()
restored = ckpt.restore(state, restore_rng=args.case != "no-rng")
step = 0 if args.case == "wrong-start" else restored
epoch = state["epoch"]
while step < args.steps:
    sampler.set_epoch(epoch)
    for x in loader:
        x = x + 0.1 * torch.randn(x.shape, generator=noise)
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if args.case != "no-advance":
            sampler.advance(len(x))
        step += 1
        ckpt.step(step, state, metrics={"loss": loss.item()})
        if step >= args.steps:
            break
    else:
        epoch += 1
        state["epoch"] = epoch
ckpt.save(step, state)
ckpt.close()

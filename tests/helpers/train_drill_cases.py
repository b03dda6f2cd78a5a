"""A tiny training script for the drill's culprit tests (issue #13, item 7).

    train_drill_cases.py --steps N --case CASE [--root DIR]

    unseeded   never seeds Python random or NumPy (and never uses them): exact otherwise
    local-ema  carries an EMA in a local variable that restore() does not give back (it writes
               state["ema"] but never reads it), and the loss depends on it: the model, the
               optimizer and the value all differ after a resume; the value is the cause
    own-root   passes its own --root to Checkpointer(root=...), overriding the launcher's
"""

from __future__ import annotations

import argparse

import torch

import slurmresume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=12)
p.add_argument("--case", default="unseeded")
p.add_argument("--root", default=None)
args = p.parse_args()

torch.manual_seed(0)  # torch is seeded; Python random and NumPy are not
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
state = {"model": model, "optimizer": opt, "ema": 0.0}
ckpt = slurmresume.Checkpointer(args.root if args.case == "own-root" else None)
step = ckpt.restore(state)
ema = 0.0 if args.case == "local-ema" else state["ema"]  # the bug: not read back from state
while step < args.steps:
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
    loss = model(x).pow(2).mean() * (1.0 + (ema if args.case == "local-ema" else 0.0))
    loss.backward()
    opt.step()
    opt.zero_grad()
    ema = 0.9 * ema + 0.1 * loss.item()
    state["ema"] = ema
    step += 1
    ckpt.step(step, state)
ckpt.save(step, state)
ckpt.close()

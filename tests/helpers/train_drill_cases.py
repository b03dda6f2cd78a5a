"""A tiny training script for the drill's culprit tests (issue #13, item 7).

    train_drill_cases.py --steps N --case CASE [--root DIR]

    unseeded   never seeds Python random or NumPy (and never uses them): exact otherwise
    local-ema  carries an EMA in a local variable that restore() does not give back (it writes
               state["ema"] but never reads it), and the loss depends on it: the model, the
               optimizer and the value all differ after a resume; the value is the cause
    own-root   passes its own --root to Checkpointer(root=...), overriding the launcher's
    no-restore saves, but never calls restore(): every restart trains again from step 0, and ends
               at the same final state (issue #28: the drill must still fail it)
    eval-gen   evaluates every 3rd step with a generator created once at start-up and kept
               outside the state: `val_loss` differs after a resume, the checkpoints do not
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
step = 0 if args.case == "no-restore" else ckpt.restore(state)
eval_gen = torch.Generator().manual_seed(7)  # eval-gen: the bug, not in state and never re-seeded
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
    metrics = {"loss": loss.item()}
    if args.case == "eval-gen" and step % 3 == 0:
        with torch.no_grad():
            metrics["val_loss"] = model(torch.randn(8, 4, generator=eval_gen)).pow(2).mean().item()
    ckpt.step(step, state, metrics=metrics)
ckpt.save(step, state)
ckpt.close()

"""An image classifier with random augmentation drawn inside DataLoader workers, resumed exactly.

    python examples/augment_train.py --steps 60 --num-workers 2 --start-method spawn
    slurmresume drill examples/augment_train.py --preemptions 2 -- --steps 24 --persistent-workers

The recipe (three lines, marked "recipe" below): the sampler yields (epoch, index) pairs and
`SeededDataset` seeds Python's `random`, NumPy and torch from (seed, epoch, index) before each
sample, so every augmentation is the same whichever worker draws it, before or after a restart.
`--without-recipe` drops those lines (the usual script: workers draw from the stream DataLoader
seeded them with) to show that the drill then fails. Training is in `main()` because workers
started with spawn or forkserver import this file.
"""

import argparse
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import slurmresume


class AugmentedImages(Dataset):
    """Synthetic 1x16x16 images of 4 classes; every read is randomly cropped, flipped, noised."""

    def __init__(self, seed: int, n: int = 96, size: int = 16, crop: int = 12):
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=g)
        base = torch.randn(4, 1, size, size, generator=g)
        self.images = base[self.labels] + 0.3 * torch.randn(n, 1, size, size, generator=g)
        self.crop = crop

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        img, room = self.images[i], self.images.shape[-1] - self.crop
        top, left = (int(v) for v in torch.randint(0, room + 1, (2,)))  # torch's global RNG
        img = img[:, top : top + self.crop, left : left + self.crop]
        if np.random.rand() < 0.5:  # NumPy's global RNG
            img = img.flip(-1)
        img = img * (1 + 0.1 * random.random())  # Python's random
        return img + 0.05 * torch.randn_like(img), self.labels[i]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--persistent-workers", action="store_true")
    p.add_argument("--start-method", choices=["fork", "spawn", "forkserver"], default="fork")
    p.add_argument("--without-recipe", action="store_true", help="the usual script, which does not resume")
    p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/augment"))
    args = p.parse_args()

    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    torch.manual_seed(args.seed + rank)

    data = AugmentedImages(args.seed)
    recipe = not args.without_recipe
    sampler = slurmresume.ResumableSampler(data, seed=args.seed, drop_last=True, with_epoch=recipe)  # recipe
    dataset = slurmresume.SeededDataset(data, seed=args.seed) if recipe else data  # recipe
    workers = args.num_workers > 0
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        num_workers=args.num_workers, persistent_workers=args.persistent_workers and workers,
                        multiprocessing_context=args.start_method if workers else None,
                        worker_init_fn=slurmresume.ignore_in_worker,
                        generator=torch.Generator().manual_seed(args.seed))  # keeps the global RNG untouched

    model = nn.Sequential(nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8 * 10 * 10, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp = nn.parallel.DistributedDataParallel(model) if distributed else model

    ckpt = slurmresume.Checkpointer(args.ckpt_dir, save_every=args.save_every)
    state = {"model": model, "optimizer": optimizer, "sampler": sampler, "loss": float("nan")}
    step = ckpt.restore(state)
    while step < args.steps:
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            sampler.advance(len(x))
            step += 1
            state["loss"] = loss.item()
            ckpt.step(step, state, metrics={"loss": state["loss"]})
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


if __name__ == "__main__":
    main()

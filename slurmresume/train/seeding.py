"""Randomness drawn while loading a sample (augmentation in DataLoader workers) that resumes exactly.

A DataLoader seeds each worker once, when an iterator is created, and the worker then draws
from that stream sample after sample. A resumed run creates its iterator mid-epoch and hands
batches to workers in another rotation, so every draw after the restart differs. No saved
state can fix that without pausing workers; seeding per sample does: each sample's draws come
from a seed derived from (seed, epoch, index), the same in any worker, any start method,
persistent or not, resumed or not, and on any world size.

    sampler = slurmresume.ResumableSampler(data, seed=seed, with_epoch=True)  # yields (epoch, index)
    dataset = slurmresume.SeededDataset(data, seed=seed)   # seeds random, NumPy, torch per sample
    loader = DataLoader(dataset, sampler=sampler, num_workers=2, ...)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from ..errors import ConfigError


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 64-bit seed for sample `index` of epoch `epoch`, well mixed (NumPy's SeedSequence), so
    neighbouring samples and epochs get unrelated streams. Pure: any process computes the same."""
    for name, value in (("seed", seed), ("epoch", epoch), ("index", index)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"sample_seed: {name} must be a non-negative int, got {value!r}")
    words = np.random.SeedSequence([int(seed), int(epoch), int(index)]).generate_state(2, np.uint32)
    return int(words[0]) | (int(words[1]) << 32)


class SeededDataset:
    """Wraps a map-style dataset: `dataset[(epoch, index)]` seeds Python's `random`, NumPy's
    global RNG and torch's default CPU generator from `sample_seed(seed, epoch, index)` and
    returns `inner[index]`. In the training process (`num_workers=0`) it then puts the previous
    states back, so the training's own streams are untouched. Keys come from
    `ResumableSampler(..., with_epoch=True)`; a plain int key is refused, since without the
    epoch every epoch would draw the same augmentation."""

    def __init__(self, dataset: Any, seed: int) -> None:
        sample_seed(seed, 0, 0)  # validates the seed now, not in a worker
        self.dataset = dataset
        self.seed = int(seed)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Any:
        import torch
        from torch.utils.data import get_worker_info

        if not (isinstance(key, tuple) and len(key) == 2):
            raise ConfigError(f"SeededDataset got key {key!r}, expected (epoch, index): use "
                              "ResumableSampler(..., with_epoch=True) as the DataLoader's sampler")
        epoch, index = key
        s = sample_seed(self.seed, epoch, index)
        # A worker's streams serve only its samples, each reseeded here: nothing to put back.
        # In the training process (num_workers=0) they are the training's streams (dropout).
        # (torch.manual_seed would also visit every device type: ~0.5 ms a sample.)
        gen = torch.default_generator
        saved = None if get_worker_info() is not None else (random.getstate(), np.random.get_state(), gen.get_state())
        try:
            random.seed(s)
            np.random.seed((s & 0xFFFFFFFF) ^ (s >> 32))  # NumPy's legacy seed takes 32 bits
            gen.manual_seed(s)
            return self.dataset[index]
        finally:
            if saved is not None:
                random.setstate(saved[0])
                np.random.set_state(saved[1])
                gen.set_state(saved[2])

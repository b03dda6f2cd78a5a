"""A DistributedSampler that knows where it is, so a resumed run sees the same batches."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, cast

import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
    """`DistributedSampler` (same index order for a given seed and epoch) plus a position.

    Tell it what the training loop consumed with `advance(n_samples)` after each batch; its
    `state_dict()` is then the exact data position, and after `load_state_dict()` iteration
    continues with the next unseen sample. `set_epoch(e)` starts epoch `e` at position 0,
    unless `e` is the epoch already restored (so the usual `for epoch in ...: set_epoch(epoch)`
    loop resumes mid-epoch). Works without torch.distributed (one replica).

    `with_epoch=True` yields `(epoch, index)` pairs instead of indices, for a `SeededDataset`
    that seeds each sample's augmentation from them (exact resume of worker-side randomness).
    """

    def __init__(self, dataset: Sized, *, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 with_epoch: bool = False) -> None:
        if num_replicas is None:
            num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        if rank is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        super().__init__(cast("Dataset[Any]", dataset), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.position = 0
        self.with_epoch = with_epoch

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())[self.position :]
        if self.with_epoch:
            return iter([(self.epoch, i) for i in indices])
        return iter(indices)

    def __len__(self) -> int:
        return max(0, self.num_samples - self.position)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.position = 0
        super().set_epoch(epoch)

    def advance(self, n: int) -> None:
        self.position += int(n)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed,
                "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        saved = int(state.get("num_replicas", self.num_replicas))
        if saved != self.num_replicas:
            # Another world size: keep the number of samples the whole job consumed this epoch.
            # The split of indices across ranks differs, so the rest of this epoch is not the
            # exact sequence an unchanged world would have seen (documented in the README).
            self.position = self.position * saved // self.num_replicas
        if state.get("seed", self.seed) != self.seed:
            raise ValueError(f"sampler was saved with seed {state['seed']}, this run uses {self.seed}")

"""ResumableSampler: the same index order as DistributedSampler for a given seed, epoch and
rank; after state_dict/load_state_dict (also through a real checkpoint) it yields exactly the
remaining indices of the interrupted epoch, and set_epoch of the restored epoch keeps the
position while a new epoch starts from the beginning."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from slurmresume import Checkpointer, ResumableSampler

N = 103  # not a multiple of the replica counts: padding / drop_last matter


def _ds(n: int = N) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _reference(epoch: int, replicas: int, rank: int, seed: int, shuffle: bool, drop_last: bool) -> list[int]:
    s = DistributedSampler(_ds(), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last)
    s.set_epoch(epoch)
    return list(s)


@pytest.mark.parametrize("replicas, rank", [(1, 0), (2, 1), (3, 0), (4, 3)])
@pytest.mark.parametrize("shuffle, drop_last", [(True, False), (True, True), (False, False)])
@pytest.mark.parametrize("consumed", [0, 1, 17, "all"])
def test_resume_mid_epoch_matches_distributed_sampler(replicas: int, rank: int, shuffle: bool,
                                                      drop_last: bool, consumed: int | str) -> None:
    epoch, seed = 3, 42
    full = _reference(epoch, replicas, rank, seed, shuffle, drop_last)
    k = len(full) if consumed == "all" else int(consumed)

    s = ResumableSampler(_ds(), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
    s.set_epoch(epoch)
    assert list(s) == full and len(s) == len(full)
    s.advance(k)
    sd = s.state_dict()
    assert sd == {"epoch": epoch, "position": k, "seed": seed, "num_replicas": replicas}

    r = ResumableSampler(_ds(), num_replicas=replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
    r.load_state_dict(sd)
    assert list(r) == full[k:] and len(r) == len(full) - k
    r.set_epoch(epoch)  # the usual `for epoch in ...: sampler.set_epoch(epoch)` loop
    assert list(r) == full[k:] and len(r) == len(full) - k
    r.set_epoch(epoch + 1)  # the next epoch starts at its beginning
    assert list(r) == _reference(epoch + 1, replicas, rank, seed, shuffle, drop_last)
    assert len(r) == len(full)


def test_overshoot_gives_an_empty_epoch_not_an_error() -> None:
    s = ResumableSampler(_ds(), shuffle=False)
    s.advance(N + 5)  # e.g. a DataLoader's last partial batch counted in full
    assert list(s) == [] and len(s) == 0


def test_seed_mismatch_is_refused() -> None:
    s = ResumableSampler(_ds(), seed=1)
    with pytest.raises(ValueError, match="seed"):
        s.load_state_dict(ResumableSampler(_ds(), seed=2).state_dict())


def test_resume_through_a_checkpoint_and_dataloader(tmp_path: Path) -> None:
    """Batches after the restore are the batches an uninterrupted loop would have seen."""
    def loader(s: ResumableSampler) -> DataLoader:
        return DataLoader(_ds(), batch_size=4, sampler=s, drop_last=True)

    ref = ResumableSampler(_ds(), seed=7)
    ref.set_epoch(2)
    uninterrupted = [b[0].tolist() for b in loader(ref)]

    s = ResumableSampler(_ds(), seed=7)
    s.set_epoch(2)
    seen = []
    for i, (x,) in enumerate(loader(s)):
        seen.append(x.tolist())
        s.advance(len(x))
        if i == 5:
            break
    Checkpointer(tmp_path, handle_signals=False).save(6, {"sampler": s})

    r = ResumableSampler(_ds(), seed=7)
    assert Checkpointer(tmp_path, handle_signals=False).restore({"sampler": r}) == 6
    assert r.epoch == 2 and r.position == 24
    r.set_epoch(2)
    rest = [b[0].tolist() for b in loader(r)]
    assert seen + rest == uninterrupted

"""Random augmentation drawn inside DataLoader workers resumes exactly with the library's recipe
(`ResumableSampler(with_epoch=True)` + `SeededDataset`), and does not without it.

In-process checks compare the batches a restarted loader yields with the tail of an
uninterrupted epoch; the drills run `examples/augment_train.py` through the real launcher, with
2 workers, fork, spawn and forkserver, persistent or not, and once without the recipe (the drill fails)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from slurmresume import ConfigError, ResumableSampler, SeededDataset, sample_seed
from slurmresume.train.signals import ignore_in_worker

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "augment_train.py"


class Noisy:
    """A dataset whose every read draws from torch, NumPy and Python's global RNGs."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), np.random.rand(), random.random()])


def _batches(recipe: bool, position: int, *, epoch: int = 1, persistent: bool = False,
             start_method: str = "fork") -> list[torch.Tensor]:
    sampler = ResumableSampler(Noisy(), seed=3, with_epoch=recipe)
    sampler.set_epoch(epoch)
    sampler.position = position
    dataset = SeededDataset(Noisy(), seed=3) if recipe else Noisy()
    loader = DataLoader(dataset, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=persistent,
                        multiprocessing_context=start_method, worker_init_fn=ignore_in_worker,
                        generator=torch.Generator().manual_seed(3))
    return list(loader)


@pytest.mark.slow
@pytest.mark.parametrize("start_method", ["fork", "forkserver"])
@pytest.mark.parametrize("persistent", [False, True])
def test_worker_augmentation_after_a_mid_epoch_restart_matches_the_uninterrupted_epoch(persistent: bool,
                                                                                       start_method: str) -> None:
    whole = _batches(True, 0, persistent=persistent, start_method=start_method)
    resumed = _batches(True, 12, persistent=persistent, start_method=start_method)  # batch 3: worker 0, not 1
    assert len(resumed) == len(whole) - 3
    for a, b in zip(whole[3:], resumed):
        assert torch.equal(a, b)


def test_without_the_recipe_worker_augmentation_differs_after_a_restart() -> None:
    whole, resumed = _batches(False, 0), _batches(False, 12)
    assert torch.equal(whole[3][:, 0], resumed[0][:, 0])  # the same samples ...
    assert not torch.equal(whole[3], resumed[0])  # ... augmented differently


def test_each_epoch_draws_new_augmentation() -> None:
    a, b = _batches(True, 0, epoch=1), _batches(True, 0, epoch=2)
    assert not torch.equal(torch.cat(a)[:, 1:], torch.cat(b)[:, 1:])


def test_seeded_dataset_leaves_the_callers_rng_streams_untouched() -> None:
    """With num_workers=0 the sample is read in the training process: its dropout stream and
    everything else it draws must not depend on the augmentation."""
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    expected = torch.rand(3), np.random.rand(3), random.random()
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    first = SeededDataset(Noisy(), seed=5)[(0, 7)]
    got = torch.rand(3), np.random.rand(3), random.random()
    assert torch.equal(got[0], expected[0]) and (got[1] == expected[1]).all() and got[2] == expected[2]
    assert torch.equal(SeededDataset(Noisy(), seed=5)[(0, 7)], first)  # the sample itself is repeatable


def test_seeded_dataset_refuses_a_plain_index() -> None:
    with pytest.raises(ConfigError, match="with_epoch=True"):
        SeededDataset(Noisy(), seed=1)[3]


def test_sample_seed_is_pure_and_separates_epochs_and_indices() -> None:
    seeds = {sample_seed(1, e, i) for e in range(4) for i in range(50)}
    assert len(seeds) == 200 and sample_seed(1, 2, 3) == sample_seed(1, 2, 3) != sample_seed(2, 2, 3)
    with pytest.raises(ConfigError, match="seed"):
        sample_seed(-1, 0, 0)


def test_sampler_with_epoch_yields_pairs_from_its_position() -> None:
    s = ResumableSampler(Noisy(), seed=4, with_epoch=True)
    plain = list(ResumableSampler(Noisy(), seed=4))
    s.set_epoch(0)
    s.advance(5)
    assert list(s) == [(0, i) for i in plain[5:]]


# -- the drill on examples/augment_train.py: 2 workers, 2 epochs of 12 steps; seed 9 plans the
# warning at step 15, three batches into the second epoch --
def drill(tmp_path: Path, *script_args: str, nproc: int = 1) -> dict:
    res = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(EXAMPLE), "--workdir", str(tmp_path / "w"),
                          "--json", "--preemptions", "1", "--seed", "9", "--nproc-per-node", str(nproc),
                          "--", "--steps", "24", "--save-every",
                          "100", "--num-workers", "2", *script_args],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode in (0, 1), res.stdout[-2000:] + res.stderr[-3000:]
    # a drill whose script crashed prints no verdict: say what the script printed (CI saw one such
    # run, exit 1 just after the resumed run's final save, with nothing else kept to read)
    assert "{" in res.stdout, f"exit {res.returncode}, no verdict:\n{res.stdout[-2000:]}\n{res.stderr[-6000:]}"
    verdict = json.loads(res.stdout[res.stdout.index("{"):])
    assert verdict["planned"] == [15] and verdict["preemptions"] == 1 and verdict["missed"] == 0, verdict
    assert verdict["saved_steps"] == [15 + (nproc > 1)], verdict  # 2 ranks act one step later
    assert (res.returncode == 0) == verdict["ok"]
    return verdict


# The drill through the launcher in the default lane: the two-rank drill below (spawn, persistent
# workers); fork and forkserver, fresh and persistent, are restarted mid-epoch in process above
# (test_worker_augmentation_after_a_mid_epoch_restart_matches_the_uninterrupted_epoch, the same
# loader and recipe). These six one-rank points run with `bash scripts/test --exhaustive`.
@pytest.mark.slow
@pytest.mark.parametrize(("persistent", "start_method"), [
    pytest.param(False, "fork", id="fresh-workers-fork", marks=pytest.mark.exhaustive),
    pytest.param(True, "fork", id="persistent-workers-fork", marks=pytest.mark.exhaustive),
    pytest.param(True, "spawn", id="persistent-workers-spawn", marks=pytest.mark.exhaustive),
    pytest.param(False, "forkserver", id="fresh-workers-forkserver", marks=pytest.mark.exhaustive),
    pytest.param(False, "spawn", id="fresh-workers-spawn", marks=pytest.mark.exhaustive),
    pytest.param(True, "forkserver", id="persistent-workers-forkserver", marks=pytest.mark.exhaustive),
])
def test_drill_passes_with_worker_augmentation(tmp_path: Path, start_method: str, persistent: bool) -> None:
    opts = ["--start-method", start_method] + (["--persistent-workers"] if persistent else [])
    verdict = drill(tmp_path, *opts)
    assert verdict["ok"] is True and verdict["differences"] == [], verdict


@pytest.mark.slow
def test_drill_passes_with_worker_augmentation_on_two_ranks(tmp_path: Path) -> None:
    """Each rank reads other samples; the seed is per sample index, so ranks need nothing more.
    Workers started by spawn, persistent (the one-rank drill of that point is in --exhaustive)."""
    verdict = drill(tmp_path, "--start-method", "spawn", "--persistent-workers", nproc=2)
    assert verdict["ok"] is True and verdict["differences"] == [], verdict


@pytest.mark.slow
def test_drill_fails_on_the_same_script_without_the_recipe(tmp_path: Path) -> None:
    verdict = drill(tmp_path, "--without-recipe")
    assert verdict["ok"] is False
    assert any(d["key"].startswith("model/") for d in verdict["differences"]), verdict["differences"]
    assert "SeededDataset" in verdict["differences"][0]["hint"]  # the first line points at the recipe


# -- torchdata's StatefulDataLoader is a member of the state like any stateful object: its sampler
# position, generator state (a tensor, into the safetensors shard), base seed and worker snapshots
# go through the tagged JSON; nothing is pickled --
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_stateful_dataloader_resumes_the_same_samples_through_a_checkpoint(tmp_path: Path,
                                                                           num_workers: int) -> None:
    stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
    from slurmresume import Checkpointer
    def loader() -> DataLoader:
        return stateful_dataloader.StatefulDataLoader(
            Noisy(), batch_size=4, shuffle=True, num_workers=num_workers, generator=torch.Generator().manual_seed(3),
            multiprocessing_context="fork" if num_workers else None)

    first = loader()
    it = iter(first)
    for _ in range(3):
        next(it)
    with Checkpointer(tmp_path / "ckpt", handle_signals=False) as ckpt:
        ckpt.save(3, {"loader": first})
    rest = [b[:, 0] for b in it]
    again = loader()
    with Checkpointer(tmp_path / "ckpt", handle_signals=False) as ckpt:
        assert ckpt.restore({"loader": again}) == 3
    resumed = [b[:, 0] for b in again]
    assert len(resumed) == len(rest) == 7
    assert all(torch.equal(a, b) for a, b in zip(rest, resumed))  # the same samples, in the same order

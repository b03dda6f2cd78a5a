"""RNG states: a save captures Python's, NumPy's global and torch's CPU generator without
consuming them; a restore puts them back, so the draws after a restore are exactly the draws
that would have followed the save. compare_checkpoints notices a diverged RNG."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
from helpers.core import tiny_model

from slurmresume import Checkpointer
from slurmresume.tools.compare import compare_checkpoints


def _draws() -> tuple:
    return (random.random(), random.getrandbits(70), float(np.random.rand()), np.random.randn(2).tolist(),
            torch.rand(3).tolist(), torch.randn(2).tolist())


def _seed(n: int) -> None:
    random.seed(n)
    np.random.seed(n)
    torch.manual_seed(n)
    # leave NumPy with a cached gaussian and Python mid-stream: the hard cases
    np.random.randn(1)
    random.random()


def test_restore_continues_every_rng_exactly(tmp_path: Path) -> None:
    _seed(11)
    expected = _draws()  # what follows this point when nothing is saved

    model, other = tiny_model(0), tiny_model(1)  # (building a module draws from torch's RNG)
    ckpt = Checkpointer(tmp_path, handle_signals=False)
    _seed(11)
    ckpt.save(5, {"model": model, "step": 5})
    assert _draws() == expected, "saving consumed a random number"

    _seed(999)  # the training ran on and scrambled everything
    _draws()
    restorer = Checkpointer(tmp_path, handle_signals=False)
    assert restorer.restore({"model": other, "step": 0}) == 5
    assert _draws() == expected

    # restore_rng=False leaves the current generators alone
    restorer = Checkpointer(tmp_path, handle_signals=False)
    _seed(3)
    mine = _draws()
    _seed(3)
    restorer.restore({"model": other, "step": 0}, restore_rng=False)
    assert _draws() == mine


def test_compare_reports_a_diverged_python_or_numpy_rng(tmp_path: Path) -> None:
    """Same model, same torch generator; only the Python (then NumPy) RNG differs."""
    def save(root: Path, py: int, npy: int) -> Path:
        model = tiny_model(0)
        torch.manual_seed(0)
        random.seed(py)
        np.random.seed(npy)
        return Checkpointer(root, handle_signals=False).save(1, {"model": model})

    a = save(tmp_path / "a", 1, 1)
    assert compare_checkpoints(a, save(tmp_path / "same", 1, 1)) == []
    for name, py, npy, stream in (("py", 2, 1, "rng.python"), ("np", 1, 2, "rng.numpy")):
        diffs = compare_checkpoints(a, save(tmp_path / name, py, npy))
        assert [d.key for d in diffs] == [stream], diffs  # each RNG stream on its own (issue #13)
        assert "RNG" in str(diffs[0])
    diffs = compare_checkpoints(a, save(tmp_path / "ignored", 2, 2), ignore_keys=("__slurmresume__",))
    assert diffs == []

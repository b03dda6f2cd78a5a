"""The "Adapt your script" checklist (README; in full with its tests: docs/adapt-your-script.md),
point by point, where no other test backs it: values carried between steps, `ckpt.step()`
inside an eval loop, a NumPy Generator, the DataLoader's own generator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.core import warn_self
from torch.utils.data import DataLoader

from slurmresume import Checkpointer


@pytest.mark.parametrize("verify", [False, True])
def test_values_carried_between_steps_come_back_in_the_dict_not_in_the_local_variable(tmp_path: Path,
                                                                                        verify: bool) -> None:
    """An RNN hidden state, a prefetched batch, a best metric: plain values. Restore puts the
    saved ones into `state` (a tensor may be loaded in place or replaced, depending on the
    restore path); a local variable that held a number keeps it, so the script must read every
    carried value back from `state` after `restore()`."""
    hidden, batch = torch.randn(2, 3), (torch.arange(4), torch.ones(4))
    with Checkpointer(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, {"hidden": hidden, "batch": batch, "best": 0.25})
    best = float("inf")
    state = {"hidden": torch.zeros(2, 3), "batch": None, "best": best}
    with Checkpointer(tmp_path, handle_signals=False) as ckpt:
        ckpt.restore(state, verify=verify)
    assert torch.equal(state["hidden"], hidden) and state["best"] == 0.25
    assert torch.equal(state["batch"][0], batch[0]) and torch.equal(state["batch"][1], batch[1])
    assert best == float("inf")  # the local variable: read state["best"] instead


def test_a_warning_during_an_eval_loop_is_saved_when_the_loop_calls_step(tmp_path: Path) -> None:
    """`ckpt.step()` is where the warning is acted on: an eval loop longer than the signal's
    lead time must call it too (with the unchanged training step: no extra periodic save)."""
    model = torch.nn.Linear(2, 2)
    state = {"model": model}
    with Checkpointer(tmp_path, save_every=5, exit_on_signal=False) as ckpt:
        assert ckpt.step(5, state) is False  # periodic save of step 5, then an eval loop at step 5
        for batch in range(3):
            if batch == 1:
                warn_self(ckpt)
            if ckpt.step(5, state):
                break
        else:
            pytest.fail("the warning was never acted on inside the eval loop")
    saved = sorted(p.name for p in tmp_path.glob("step_*"))
    assert saved == ["step_000000005"]


def test_a_numpy_generator_state_round_trips_as_a_plain_value(tmp_path: Path) -> None:
    """`np.random.default_rng()` has no state_dict(): keep `rng.bit_generator.state` (a dict of
    ints, 128-bit ones included) in `state` and set it back after `restore()`."""
    rng = np.random.default_rng(5)
    rng.random(3)
    with Checkpointer(tmp_path, handle_signals=False) as ckpt:
        ckpt.save(1, {"np_rng": rng.bit_generator.state})
    expected = rng.random(4)
    state = {"np_rng": None}
    with Checkpointer(tmp_path, handle_signals=False) as ckpt:
        ckpt.restore(state)
    again = np.random.default_rng(0)
    again.bit_generator.state = state["np_rng"]
    assert (again.random(4) == expected).all()


def test_a_dataloader_without_its_own_generator_draws_from_the_global_torch_stream() -> None:
    """Each iterator draws a base seed; a resumed run creates one mid-epoch where the
    uninterrupted run did not, so without `generator=` the global stream (dropout) shifts."""
    data = list(range(8))
    before = torch.get_rng_state()
    iter(DataLoader(data, generator=torch.Generator().manual_seed(0)))
    assert torch.equal(torch.get_rng_state(), before)
    iter(DataLoader(data))
    assert not torch.equal(torch.get_rng_state(), before)

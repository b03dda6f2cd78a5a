"""Issue #28, Lightning: the emergency save happens after every hook of the step. Lightning runs
the LightningModule's `on_train_batch_end` after every callback's, and callbacks in list order:
state updated by the module hook, or by a callback listed after `SlurmResume`, used to miss the
saved step's update (one EMA update short per preemption). Through the real drill (launcher,
torchrun, warnings at seeded steps); 2 ranks also cover DDP and the pipelined agreement."""

from __future__ import annotations

import pytest
from helpers.integrations import drill as run_drill
from helpers.procs import HELPERS

SCRIPT = HELPERS / "lightning_cases.py"


# Each case alone; the default lane drills all three together, on 1 and 2 ranks (below).
@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize(("case", "nproc"), [("module-ema", 1), ("callback-ema", 2), ("module-ema", 2),
                                             ("callback-ema", 1)])
def test_state_updated_after_our_hook_is_in_the_emergency_save(tmp_path, case: str, nproc: int) -> None:
    verdict = run_drill(tmp_path, str(SCRIPT), nproc, "--steps", "16", "--case", case, seed=3)
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])
    assert verdict["preemptions"] == 2 and verdict["missed"] == 0


STEPS, EVERY = 16, 4
EVERY_CASE = "module-ema,callback-ema,early-stop"


def seed_with_one_warning_on_a_validation_step(nproc: int) -> int:
    """The drill's own plan (`pick_steps`): a seed whose two warnings land one on a validation step
    and one on a step without validation, counting the one-step lag of the pipelined agreement
    with 2 ranks."""
    from slurmresume.tools.drill import pick_steps

    lag = 0 if nproc == 1 else 1
    for seed in range(1000):
        steps = [s + lag for s in pick_steps(STEPS, 2, seed)]
        if all(s < STEPS for s in steps) and sorted(s % EVERY == 0 for s in steps) == [False, True]:
            return seed
    raise AssertionError("no such seed")


# 2 ranks in the default lane (the pipelined agreement's lag, DDP); 1 rank with --exhaustive: one
# rank's Lightning drill is test_lightning_shapes' gan point, and the hook order is the same code.
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.exhaustive), 2])
def test_the_validation_due_at_the_preempted_step_runs_as_it_would_have(tmp_path, nproc: int) -> None:
    """Every case at once (module EMA, callback EMA after ours, EarlyStopping), one warning on a
    validation step and one off it: EarlyStopping.wait_count (in the final checkpoint's callback
    state) and that step's val_loss (the metrics stream) equal the uninterrupted run's (the old
    code skipped that validation), and so do both EMAs (the old code saved before the hooks that
    Lightning runs after ours: one update short per preemption)."""
    verdict = run_drill(tmp_path, str(SCRIPT), nproc, "--steps", str(STEPS), "--case", EVERY_CASE,
                        seed=seed_with_one_warning_on_a_validation_step(nproc))
    assert sorted(s % EVERY == 0 for s in verdict["saved_steps"]) == [False, True], verdict["saved_steps"]
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5],
                                                                 verdict["metric_difference"], verdict["stderr"])
    assert verdict["preemptions"] == 2 and verdict["missed"] == 0


@pytest.mark.slow
@pytest.mark.exhaustive
def test_a_warning_on_the_epochs_last_step_with_its_validation_resumes_exactly(tmp_path) -> None:
    """Seed 61 plans warnings at 12 and 32; step 32 ends the epoch (256 samples, batches of 8)
    and validates: the save comes after that validation (Lightning's 'restarted on last')."""
    verdict = run_drill(tmp_path, str(SCRIPT), 1, "--steps", "40", "--case", "early-stop", seed=61)
    assert verdict["saved_steps"] == [12, 32], verdict["saved_steps"]
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])

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


@pytest.mark.slow
@pytest.mark.parametrize(("case", "nproc"), [("module-ema", 1), ("callback-ema", 2),
                                             pytest.param("module-ema", 2, marks=pytest.mark.exhaustive),
                                             pytest.param("callback-ema", 1, marks=pytest.mark.exhaustive)])
def test_state_updated_after_our_hook_is_in_the_emergency_save(tmp_path, case: str, nproc: int) -> None:
    verdict = run_drill(tmp_path, str(SCRIPT), nproc, "--steps", "16", "--case", case, seed=3)
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])
    assert verdict["preemptions"] == 2 and verdict["missed"] == 0


STEPS, EVERY = 16, 4


def seed_on_validation_steps(nproc: int) -> int:
    """The drill's own plan (`pick_steps`): a seed whose two warnings land on validation steps,
    counting the one-step lag of the pipelined agreement with 2 ranks."""
    from slurmresume.tools.drill import pick_steps

    lag = 0 if nproc == 1 else 1
    return next(seed for seed in range(1000)
                if all((s + lag) % EVERY == 0 and s + lag < STEPS for s in pick_steps(STEPS, 2, seed)))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_validation_due_at_the_preempted_step_runs_as_it_would_have(tmp_path, nproc: int) -> None:
    """EarlyStopping.wait_count (in the final checkpoint's callback state) and that step's
    val_loss (the metrics stream) equal the uninterrupted run's; the old code skipped it."""
    verdict = run_drill(tmp_path, str(SCRIPT), nproc, "--steps", str(STEPS), "--case", "early-stop",
                        seed=seed_on_validation_steps(nproc))
    assert all(s % EVERY == 0 for s in verdict["saved_steps"]), verdict["saved_steps"]  # on validation steps
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

"""Issue #28, accelerate: `Accelerator(gradient_accumulation_steps=N)` with
`accelerator.accumulate(model)` (tests/helpers/accelerate_accum.py). With the README's placement
(`step += 1`, the scheduler and `ckpt.step()` only when `accelerator.sync_gradients`) the drill
passes bitwise at 1 and 2 ranks; with `ckpt.step()` after every micro-batch it fails, which
shows the drill can see the difference.

Seeds: the recipe's saves are always at optimizer steps, so any seed does; for the naive
placement the test searches the drill's own plan (`pick_steps`) for a seed whose warnings land
between two micro-batches of one optimizer step."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.integrations import drill as run_drill

from slurmresume.tools.drill import pick_steps

pytest.importorskip("accelerate")
SCRIPT = str(Path(__file__).parent / "helpers" / "accelerate_accum.py")
STEPS, ACCUM, WARNINGS = 12, 3, 2


def seed_off_boundaries(warnings: int = WARNINGS) -> int:
    return next(seed for seed in range(1000)
                if all(s % ACCUM != 0 for s in pick_steps(STEPS, warnings, seed)))


# 2 ranks in the default lane (DDP's no_sync inside accumulate); 1 rank with --exhaustive: the
# recipe's placement is the same code, and one rank's accelerate drill is
# test_integrations_accelerate's and test_a_save_between_micro_batches_fails_the_drill's
@pytest.mark.slow  # ~45 s each
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.exhaustive), 2])
def test_gradient_accumulation_resumes_exactly_with_the_recipe(tmp_path: Path, nproc: int) -> None:
    verdict = run_drill(tmp_path, SCRIPT, nproc, "--steps", str(STEPS), "--accum", str(ACCUM),
                        seed=seed_off_boundaries(), preemptions=WARNINGS)
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])
    assert verdict["differences"] == [] and verdict["preemptions"] == WARNINGS and verdict["missed"] == 0


@pytest.mark.slow
def test_a_save_between_micro_batches_fails_the_drill(tmp_path: Path) -> None:
    # one warning between micro-batches: the first resume already differs
    verdict = run_drill(tmp_path, SCRIPT, 1, "--steps", str(STEPS), "--accum", str(ACCUM),
                        "--placement", "naive", seed=seed_off_boundaries(1), preemptions=1)
    assert all(s % ACCUM != 0 for s in verdict["saved_steps"]), verdict["saved_steps"]  # mid-accumulation
    assert verdict["returncode"] != 0 and verdict["ok"] is False
    assert verdict["differences"], verdict

"""Issue #28, HF Trainer: a warning that lands on an evaluation step (`eval_strategy="steps"`).
Trainer evaluates after `on_step_end`; the step boundary used to run there, so the emergency save
came before the evaluation and the resumed run skipped it. The eval loader's iterator draws from
the global torch RNG, so every later dropout mask, the optimizer and the model differed.

Seeds: the test searches the drill's own seeded plan (`pick_steps`) for the first seed whose
warnings land on evaluation steps (every 4th step), counting the one-step lag of the pipelined
agreement with 2 ranks (a warning planned at step s is saved at s+1 there)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.integrations import drill as run_drill

from slurmresume.tools.drill import pick_steps

pytest.importorskip("transformers")
STEPS, EVERY, WARNINGS = 24, 4, 2


def seed_on_eval_steps(nproc: int) -> int:
    lag = 0 if nproc == 1 else 1
    return next(seed for seed in range(1000)
                if all((s + lag) % EVERY == 0 and s + lag < STEPS for s in pick_steps(STEPS, WARNINGS, seed)))


# Both points with `bash scripts/test --exhaustive`. The default lane drills the same case on 3
# ranks (test_ddp_frameworks::test_hf_trainer_ddp_on_3_ranks_passes_the_drill: --eval-every 4, a
# seed of seed_on_eval_steps(3), both saves on evaluation steps, one step after the warnings as on
# 2 ranks); the Trainer on one rank: test_hf_random_collator's `fixed` point.
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.exhaustive),
                                   pytest.param(2, marks=pytest.mark.exhaustive)])
def test_a_warning_on_an_evaluation_step_resumes_exactly(tmp_path: Path, nproc: int) -> None:
    seed = seed_on_eval_steps(nproc)
    verdict = run_drill(tmp_path, "hf_trainer_train.py", nproc, "--steps", str(STEPS), "--batch-size", "8",
                        "--eval-every", str(EVERY), seed=seed, preemptions=WARNINGS)
    assert all(s % EVERY == 0 for s in verdict["saved_steps"]), verdict["saved_steps"]  # on evaluation steps
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])
    assert verdict["differences"] == [] and verdict["preemptions"] == WARNINGS and verdict["missed"] == 0

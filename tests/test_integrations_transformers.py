"""Hugging Face `Trainer` with `SlurmResumeCallback`: the drill passes bitwise through the real
launcher and torchrun with 1 and 2 ranks (mid-epoch and epoch-boundary resumes)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.integrations import drill as run_drill

pytest.importorskip("transformers")


# Seed 85: warnings at 7 and 23 of 24. One rank: 8 steps per epoch, both resumes mid-epoch
# (Trainer skips the trained batches); two ranks: 4 per epoch, saves at 8 and 24, epoch ends.
# Both points with `bash scripts/test --exhaustive` only. The default lane drills this script on 3
# ranks in test_ddp_frameworks (DDP, evaluations, saves at 4 and 20, both mid-epoch: 3 steps an
# epoch there) and the Trainer on one rank in test_hf_random_collator (its `fixed` point); the
# signal path of a 2-rank HF run: test_integrations_signals.
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.exhaustive),
                                   pytest.param(2, marks=pytest.mark.exhaustive)])
def test_drill_passes_bitwise_on_the_hf_trainer_example(tmp_path: Path, nproc: int) -> None:
    verdict = run_drill(tmp_path, "hf_trainer_train.py", nproc, "--steps", "24", "--batch-size", "8")
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])
    assert verdict["differences"] == [] and verdict["preemptions"] == 2 and verdict["missed"] == 0
    assert verdict["saved_steps"] == ([7, 23] if nproc == 1 else [8, 24])

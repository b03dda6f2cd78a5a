"""The accelerate recipe (examples/accelerate_train.py: accelerator.prepare + a Checkpointer over
the unwrapped objects): the drill passes bitwise with 1 and 2 ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.integrations import drill as run_drill

pytest.importorskip("accelerate")


@pytest.mark.slow
# one rank count here; the other with `bash scripts/test --exhaustive`
@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.exhaustive)])
def test_drill_passes_bitwise_on_the_accelerate_example(tmp_path: Path, nproc: int) -> None:
    verdict = run_drill(tmp_path, "accelerate_train.py", nproc, "--steps", "24", "--batch-size", "8")
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])
    assert verdict["differences"] == [] and verdict["preemptions"] == 2 and verdict["missed"] == 0

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

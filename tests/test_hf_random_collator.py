"""Issue #28, HF Trainer: a data collator that draws random numbers (the stock
`DataCollatorForLanguageModeling`, MLM masking) is NOT exact; docs/integrations.md lists it under
"Not exact". This test documents why, and fails once it becomes exact (then move that line).

The reason: Trainer's training loader (accelerate's DataLoaderShard) collates one batch ahead,
so the batch after the saved step was collated - its masks drawn from the global RNG - before
the save, and those draws are in no checkpoint; the resumed run collates it again from the
restored state. The same script with the same masking drawn from a generator seeded by the
batch itself (no global draws) passes, so the collator's draws are the only difference.

Seed: any; with 16 steps of 4 sentences (10 per epoch) the warnings land mid-epoch."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.integrations import drill as run_drill

pytest.importorskip("transformers")
SCRIPT = str(Path(__file__).parent / "helpers" / "hf_mlm_train.py")


@pytest.mark.slow  # ~1 min each
@pytest.mark.parametrize("collator, exact", [("random", False), ("fixed", True)])
def test_a_collator_that_draws_from_the_global_rng_is_not_exact(tmp_path: Path, collator: str, exact: bool) -> None:
    warnings = 2 if exact else 1  # the drift shows from the first resume on; the exact control resumes twice
    verdict = run_drill(tmp_path, SCRIPT, 1, "--steps", "16", "--collator", collator, seed=85, preemptions=warnings)
    assert verdict["preemptions"] == warnings and verdict["missed"] == 0, verdict
    assert verdict["ok"] is exact and (verdict["returncode"] == 0) is exact, (verdict["differences"][:3],
                                                                             verdict["stderr"])
    if not exact:  # the weights themselves drift, not only a bookkeeping field
        assert any("model" in str(d.get("path", d)) for d in verdict["differences"]), verdict["differences"][:5]

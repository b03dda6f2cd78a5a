"""Campaign 5, CI size (tests/campaigns/hostile.py): the hostile corpus of tests/hostile/corpus.py
in full, plus 30 seeded structural fuzz trials: refused with a clear error, nothing outside the
step directory opened, nothing unpickled or executed, memory bounded, nothing hangs."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_hostile_checkpoint_campaign(tmp_path: Path) -> None:
    from hostile.corpus import CASES

    report = run_in_subprocess("hostile", 30, tmp_path)
    assert_clean(report)
    assert report["stats"]["corpus_cases"] == len(CASES)
    growth = report["stats"]["max_rss_growth_mib"]
    assert growth["header-claims-2^62"] < 64 and growth["header-huge-shape"] < 64

"""Campaign 4, CI size (tests/campaigns/corrupt.py): 200 seeded damages after commit (bit flips,
zeroed ranges, truncation, deletion, hand edits): restore(verify=True) never returns damaged
data, falls back naming the file; `verify --all` (also the real CLI) flags it."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_corruption_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("corrupt", 200, tmp_path)
    assert_clean(report)
    assert report["trials"] == 200
    assert report["stats"]["partial_loads_verify"] == 0
    assert report["stats"]["detected"] >= 180 and report["stats"]["cli_verify_runs"] >= 8

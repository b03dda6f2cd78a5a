"""Campaign 8, CI size (tests/campaigns/readers.py): three readers list the root while a writer
saves; every "complete" checkpoint they see has all its files whole. A negative control (a
writer that puts the marker first) must be caught."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_readers_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("readers", 1, tmp_path)
    assert_clean(report)
    assert report["stats"]["control_broken_writer_caught"] > 0
    assert report["stats"]["complete_observations"] >= 100
    assert report["stats"]["partial_checkpoints_seen_complete"] == 0

"""Campaign 1, CI size (tests/campaigns/crash.py): a SIGKILL at every file-system step of six
save/prune scenarios (~145 kills) plus 60 seeded random SIGKILLs of a training process while it
saves. After each: no partial restore, no committed checkpoint lost, the next save works."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_crash_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("crash", 60, tmp_path)
    assert_clean(report)
    stats = report["stats"]
    assert report["trials"] >= 200
    assert stats["boundary_kills"] >= 140 and set(stats["labels"]) == {
        "save", "save-over-stale", "save+retention", "prune", "world2", "async"}
    assert stats["partial_loads"] == 0 and stats["lost_committed"] == 0
    assert stats.get("random_kills", 0) >= 40  # the rest end in an emergency exit first
    assert stats.get("kill_left_partial_dir", 0) > 0  # random kills do land inside saves

"""Campaign 7, CI size (tests/campaigns/concurrency.py): one ~6 s round of a writer, two prunes
(library and CLI) and a status reader at once while the lock file is swapped for a symlink."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_concurrency_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("concurrency", 1, tmp_path)
    assert_clean(report)
    s = report["stats"]
    assert s["saves_committed"] >= 10 and s["prunes_done"] >= 10 and s["lock_swaps"] >= 3
    assert s["status_snapshots"] >= 10 and s.get("dirs_deleted", 0) > 0

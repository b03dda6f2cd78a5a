"""Campaign 7, CI size (scripts/campaign_concurrency.py): one ~6 s round of a writer, two prunes
(library and CLI) and a status reader at once while the lock file is swapped for a symlink."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from campaign import assert_clean, run_in_subprocess  # noqa: E402


@pytest.mark.slow
def test_concurrency_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("concurrency", 1, tmp_path)
    assert_clean(report)
    s = report["stats"]
    assert s["saves_committed"] >= 10 and s["prunes_done"] >= 10 and s["lock_swaps"] >= 3
    assert s["status_snapshots"] >= 10 and s.get("dirs_deleted", 0) > 0

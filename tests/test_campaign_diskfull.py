"""Campaign 2, CI size (tests/campaigns/diskfull.py): ENOSPC in every phase of a save on a small
tmpfs (bytes and inodes swept page by page, O_DIRECT and buffered; ENOSPC at fsync simulated).
Needs root for `mount -t tmpfs`; skipped otherwise, saying why."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_disk_full_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("diskfull", 1, tmp_path)
    if report["skipped"]:
        pytest.skip(report["skipped"])
    assert_clean(report)
    phases = " | ".join(report["stats"]["phases"])
    for phase in (".inprogress (write", "shard (write", "shard (fsync", "manifest.json (write",
                  "manifest.json (fsync", "COMMITTED (write", "COMMITTED (fsync", "shard (create",
                  "step dir (mkdir"):
        assert phase in phases, (phase, phases)
    assert report["trials"] >= 50

"""Campaign 3, CI size (tests/campaigns/ioerror.py): an injected EIO at every file-system step
of the six save/prune scenarios, in raise and warn mode: SaveError, no marker, nothing left
behind, previous checkpoint intact, the next save works."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_io_error_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("ioerror", 1, tmp_path)
    assert_clean(report)
    assert report["trials"] >= 200
    assert report["stats"]["save_error"] >= 80 and report["stats"]["prune_error"] >= 4
    assert report["stats"]["partial_loads"] == 0

"""Campaign 6, CI size (tests/campaigns/args.py): every ASCII control character in every `submit`
option, the --sbatch key and value, the script path and arguments, --resume-from, --branch and
slurmresume.toml defaults (plus 100 seeded fuzz trials): refused, nothing written, the fake sbatch
never called; script arguments reach torchrun verbatim as list elements."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_hostile_arguments_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("args", 100, tmp_path)
    assert_clean(report)
    assert report["stats"]["matrix_trials"] >= 18 * 33
    assert report["trials"] >= report["stats"]["matrix_trials"] + 100

"""Campaign 9 (tests/campaigns/perms.py): under umask 022 and 077 (and 027/002/000) nothing that
slurmresume creates (root and parents, step files, events.jsonl, the lock) has group/world write
bits or more than the umask allows."""

from __future__ import annotations

from pathlib import Path

import pytest
from campaigns.harness import assert_clean, run_in_subprocess


@pytest.mark.slow
def test_permissions_campaign(tmp_path: Path) -> None:
    report = run_in_subprocess("perms", 1, tmp_path)
    assert_clean(report)
    modes = report["stats"]["modes"]
    strict = modes["077"]
    for rel in ("a", "a/b/root", "a/b/root/events.jsonl", "a/b/root/.slurmresume.lock",
                "a/b/root/step_000000002/COMMITTED", "a/b/root/step_000000002/rank-00000-of-00001.safetensors"):
        assert int(strict[rel], 8) & 0o077 == 0, (rel, strict[rel])
    for rel, mode in modes["022"].items():
        assert int(mode, 8) & 0o022 == 0, (rel, mode)

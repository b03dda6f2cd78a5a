"""The writer calibration cache is a speed hint (issue #27): whatever is wrong with it (nested
JSON of any depth, bad JSON, oversize, a directory in its place, a read-only directory), every
save succeeds, emergency saves included, on the default path, with one warning."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from slurmresume import Checkpointer
from slurmresume.checkpoint import calibrate
from slurmresume.checkpoint.layout import MARKER


def _damage(kind: str, cache: Path) -> None:
    cache.parent.mkdir(parents=True, exist_ok=True)
    if kind == "nested":
        cache.write_text("[" * 200_000 + "]" * 200_000)  # json.loads: RecursionError
    elif kind == "nested-in-object":
        cache.write_text('{"k": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_001)
    elif kind == "bad":
        cache.write_text('{"host:1:ext4:/": {"strategy": ')
    elif kind == "oversize":
        cache.write_text("{" + " " * (calibrate.MAX_CACHE_BYTES + 10) + "}")
    elif kind == "directory":
        cache.mkdir()
    elif kind == "readonly-dir":
        cache.write_text("[" * 200_000)
        cache.parent.chmod(0o555)


@pytest.mark.parametrize("kind", ["nested", "nested-in-object", "bad", "oversize", "directory", "readonly-dir"])
def test_a_damaged_writer_cache_never_fails_a_save(tmp_path, monkeypatch, caplog, kind: str) -> None:
    cache = tmp_path / "cache" / "writer.json"
    monkeypatch.setenv(calibrate.CACHE_ENV, str(cache))
    monkeypatch.delenv(calibrate.ENV, raising=False)
    monkeypatch.setattr(calibrate, "_memo", {})
    monkeypatch.setattr(calibrate, "_warned", set())
    _damage(kind, cache)
    root = tmp_path / "root"
    try:
        with caplog.at_level(logging.WARNING, logger="slurmresume"), Checkpointer(root, handle_signals=False) as ck:
            ck.save(1, {"w": torch.ones(4)})
            with calibrate.emergency():  # as an emergency save after a signal
                ck.save(2, {"w": torch.ones(4) * 2})
    finally:
        os.chmod(cache.parent, 0o755)
    assert (root / "step_000000001" / MARKER).exists() and (root / "step_000000002" / MARKER).exists()
    if kind != "readonly-dir":
        warned = [r for r in caplog.records if "writer calibration cache" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]

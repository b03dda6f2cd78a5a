"""Issue #33, the warm restore's cost: opted in (SLURMRESUME_RESTORE_WARM=1), when this rank's
shards are in the page cache (same world size), a restore verifies them in a first pass through one small buffer and reads them into the
live tensors in a second, both from memory, instead of faulting in staging memory and copying
from it; a cold part is staged (read once from the disk). Either way nothing in `state` is
touched before every byte was verified."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers.core import shard

from slurmresume import Checkpointer
from slurmresume.checkpoint.residency import all_cached
from slurmresume.events import read_events


def drop_cache(root: Path) -> None:
    for p in root.rglob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_all_cached_follows_the_page_cache(tmp_path: Path) -> None:
    p = tmp_path / "f.safetensors"
    p.write_bytes(os.urandom(1 << 20))
    assert all_cached(p) and not all_cached(tmp_path / "missing")
    drop_cache(tmp_path)
    if all_cached(p):
        pytest.skip("this file system keeps its pages (tmpfs?)")
    p.read_bytes()
    assert all_cached(p)


@pytest.mark.parametrize(("warm", "opted_in"), [(True, True), (False, True), (True, False)])
def test_a_warm_restore_reads_twice_from_memory_and_a_cold_one_stages(tmp_path: Path, warm: bool, opted_in: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Real outcomes: the bytes each plan reads (the `restored` event: two passes warm and opted
    in with SLURMRESUME_RESTORE_WARM=1, else one: staged), the user's tensor objects kept and
    holding the saved bytes."""
    if opted_in:
        monkeypatch.setenv("SLURMRESUME_RESTORE_WARM", "1")
    else:
        monkeypatch.delenv("SLURMRESUME_RESTORE_WARM", raising=False)
    saved = {"w": torch.randn(300_000), "b": torch.arange(7, dtype=torch.int64)}
    with Checkpointer(tmp_path, handle_signals=False) as ck:
        ck.save(1, saved)
    if warm:  # a save may bypass the page cache (O_DIRECT): read it once, as a restore before did
        shard(tmp_path, 1).read_bytes()
        assert all_cached(shard(tmp_path, 1))
    else:
        drop_cache(tmp_path)
        if all_cached(shard(tmp_path, 1)):
            pytest.skip("this file system keeps its pages (tmpfs?)")
    w, b = torch.zeros(300_000), torch.zeros(7, dtype=torch.int64)
    state = {"w": w, "b": b}
    with Checkpointer(tmp_path, handle_signals=False) as ck:
        assert ck.restore(state) == 1
    assert state["w"] is w and state["b"] is b and torch.equal(w, saved["w"]) and torch.equal(b, saved["b"])
    event = [e for e in read_events(tmp_path) if e["event"] == "restored"][-1]
    assert event["read_bytes"] == [(2 if warm and opted_in else 1) * event["needed_bytes"][0]], event

"""The streaming O_DIRECT writer and asynchronous saves."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import slurmresume
from slurmresume.checkpoint import calibrate, fsio
from slurmresume.errors import SaveError


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big": torch.randn(11_000_001, generator=g),  # > one 32 MiB staging buffer, odd length
        "bf16": torch.randn(3, 1001, generator=g).to(torch.bfloat16),
        "ints": torch.arange(7, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "view": torch.randn(64, 64, generator=g).t(),  # non-contiguous
        "flag": torch.tensor([True, False]),
    }


@pytest.mark.parametrize("direct", [True, False])
def test_writer_output_is_stock_safetensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    monkeypatch.setenv("SLURMRESUME_NO_ODIRECT", "0" if direct else "1")
    state = _state()
    ck = slurmresume.Checkpointer(tmp_path, handle_signals=False)
    ck.save(1, {"t": state})
    shard = tmp_path / "step_000000001" / "rank-00000-of-00001.safetensors"
    loaded = load_file(shard)
    for k, v in state.items():
        assert torch.equal(loaded[f"t/{k}"], v), k
    # size exact (the O_DIRECT padding was truncated away) and checksum verified
    info = slurmresume.find_latest(tmp_path, verify=True)
    assert info is not None and info.verified is True


def test_direct_and_buffered_write_identical_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    digests = []
    for mode in ("0", "1"):
        monkeypatch.setenv("SLURMRESUME_NO_ODIRECT", mode)
        p = tmp_path / f"f{mode}"
        sink = calibrate.open_sink(p)
        assert sink.direct == (mode == "0")
        for chunk in (b"x" * 13, bytes(range(256)) * 300_000, b"", b"tail"):
            sink.feed(chunk)
        sink.finish()
        digests.append(hashlib.sha256(p.read_bytes()).hexdigest())
        assert p.stat().st_size == 13 + 256 * 300_000 + 4
    assert digests[0] == digests[1]


def test_async_snapshot_is_a_copy_not_a_view(tmp_path: Path) -> None:
    """The peer bug (pytorch #144657): an update right after save must not leak into it."""
    model = torch.nn.Linear(512, 512)
    ck = slurmresume.Checkpointer(tmp_path, handle_signals=False, async_save=True, save_every=1)
    before = model.weight.detach().clone()
    ck.step(1, {"model": model})
    with torch.no_grad():
        model.weight.add_(1.0)
    ck.wait()
    saved = load_file(tmp_path / "step_000000001" / "rank-00000-of-00001.safetensors")
    assert torch.equal(saved["model/weight"], before)
    ck.close()


def test_async_buffers_are_reused(tmp_path: Path) -> None:
    model = torch.nn.Linear(256, 256)
    ck = slurmresume.Checkpointer(tmp_path, handle_signals=False, async_save=True, save_every=1)
    ck.step(1, {"model": model})
    ptrs = {k: v.data_ptr() for k, v in ck._async.pool.buffers.items()}
    ck.step(2, {"model": model})
    ck.wait()
    assert {k: v.data_ptr() for k, v in ck._async.pool.buffers.items()} == ptrs
    assert ck._async.pool.nbytes < 2 * sum(p.numel() * 4 for p in model.parameters()) + 50_000
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000000001", "step_000000002"]
    ck.close()


def test_async_error_is_raised_on_training_thread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(8, 8)
    ck = slurmresume.Checkpointer(tmp_path, handle_signals=False, async_save=True, save_every=1)
    ck.step(1, {"model": model})
    ck.wait()
    monkeypatch.setattr(fsio, "_ACTIVE", True)
    monkeypatch.setattr(fsio, "_FAIL", ("fsync.shard", 1))
    monkeypatch.setattr(fsio, "_counts", {})
    ck.step(2, {"model": model})  # fails in the background
    with pytest.raises(SaveError, match="injected I/O error"):
        ck.wait()
    assert not (tmp_path / "step_000000002" / "COMMITTED").exists()
    info = slurmresume.find_latest(tmp_path)
    assert info is not None and info.step == 1
    monkeypatch.setattr(fsio, "_FAIL", None)
    ck.step(3, {"model": model})  # the next save works again
    ck.close()
    assert (tmp_path / "step_000000003" / "COMMITTED").exists()


def test_async_error_with_warn_policy_continues(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = torch.nn.Linear(8, 8)
    ck = slurmresume.Checkpointer(tmp_path, handle_signals=False, async_save=True, save_every=1,
                                  on_save_error="warn")
    monkeypatch.setattr(fsio, "_ACTIVE", True)
    monkeypatch.setattr(fsio, "_FAIL", ("rename.marker", 1))
    monkeypatch.setattr(fsio, "_counts", {})
    ck.step(1, {"model": model})
    ck._async.thread.join()
    ck.step(2, {"model": model})  # warns about step 1 and saves step 2
    ck.close()
    assert not (tmp_path / "step_000000001" / "COMMITTED").exists()
    assert (tmp_path / "step_000000002" / "COMMITTED").exists()


def test_save_waits_for_inflight_async(tmp_path: Path) -> None:
    model = torch.nn.Linear(1024, 1024)
    ck = slurmresume.Checkpointer(tmp_path, handle_signals=False, async_save=True, save_every=1)
    ck.step(1, {"model": model})
    ck.save(2, {"model": model})  # must not interleave with the in-flight step 1
    assert ck._async.thread is None
    assert (tmp_path / "step_000000001" / "COMMITTED").exists()
    assert (tmp_path / "step_000000002" / "COMMITTED").exists()
    ck.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_pinned_and_consistent(tmp_path: Path) -> None:  # pragma: no cover - GPU only
    model = torch.nn.Linear(4096, 4096).cuda()
    ck = slurmresume.Checkpointer(tmp_path, handle_signals=False, async_save=True, save_every=1)
    before = model.weight.detach().cpu()
    ck.step(1, {"model": model})
    with torch.no_grad():
        model.weight.add_(1.0)
    ck.wait()
    assert all(b.is_pinned() for b in ck._async.pool.buffers.values() if b.numel() > 100)
    saved = load_file(tmp_path / "step_000000001" / "rank-00000-of-00001.safetensors")
    assert torch.equal(saved["model/weight"], before)

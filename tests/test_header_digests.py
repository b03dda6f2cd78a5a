"""Shard headers carry the block digests a restore checks (`shard.BLOCKS_KEY`, beside the fine
digests of DTensor pieces): a restore reads them from the header it reads anyway (verified
against the manifest's header digest) and opens no index file. Issue #29's "metadata operations
per restore <= 4 x W": before, every restoring rank opened its own index and each source rank's."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers.core import model_equal, restore_fresh, save_steps, step_dir, tiny_model, tiny_state
from safetensors.torch import load_file

from slurmresume import Checkpointer
from slurmresume.checkpoint import shard as shard_mod
from slurmresume.checkpoint.shardread import read_header

SHARD, INDEX = "rank-00000-of-00001.safetensors", "rank-00000.index.json"


def _opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    opened: list[str] = []
    real = os.open

    def recording(path: str | os.PathLike[str], flags: int, *a: object, **k: object) -> int:
        opened.append(os.path.basename(os.fspath(path)))
        return real(path, flags, *a, **k)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "open", recording)
    return opened


def _header_and_index(root: Path) -> tuple[dict[str, str], dict[str, dict]]:
    d = step_dir(root, 1)
    header, _ = read_header(d, SHARD, (d / SHARD).stat().st_size)
    return header.blocks(d / SHARD), json.loads((d / INDEX).read_text())["tensors"]


def test_the_header_carries_the_digests_of_the_index(tmp_path: Path) -> None:
    save_steps(tmp_path, [1]).close()
    blocks, index = _header_and_index(tmp_path)
    assert blocks and set(blocks) == set(index)  # a plain state: every tensor, within the budget
    assert all("".join(index[n]["xxh3"]) == d for n, d in blocks.items())
    assert set(load_file(str(step_dir(tmp_path, 1) / SHARD))) == set(index)  # still a stock safetensors file


def test_a_restore_opens_no_index_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_steps(tmp_path, [1]).close()
    opened = _opens(monkeypatch)
    step, state = restore_fresh(tmp_path)
    assert step == 1 and model_equal(state["model"], tiny_model(1))
    assert SHARD in opened and not [f for f in opened if f.endswith(".index.json")], opened


def test_tensors_over_the_budget_are_checked_against_the_index(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A shard of large plain tensors (DDP) hashes at most BLOCKS_MAX bytes before its header; the
    rest are checked against the index, which the restore then opens, and every byte still is."""
    monkeypatch.setattr(shard_mod, "BLOCKS_MAX", 64)
    save_steps(tmp_path, [1]).close()
    blocks, index = _header_and_index(tmp_path)
    assert blocks and set(blocks) < set(index)
    opened = _opens(monkeypatch)
    step, state = restore_fresh(tmp_path)
    assert step == 1 and model_equal(state["model"], tiny_model(1)) and INDEX in opened
    d = step_dir(tmp_path, 1)
    raw = bytearray((d / SHARD).read_bytes())  # a flipped byte of the last tensor, one the header has no digest for
    raw[-1] ^= 0x01
    (d / SHARD).write_bytes(bytes(raw))
    state = tiny_state(987654)
    with pytest.raises(Exception, match="checksum"):
        Checkpointer(tmp_path, handle_signals=False).restore(state, step=1)


def test_a_tensor_changed_after_its_digests_fails_the_save(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header's digests are taken before the first byte is written; a tensor that changes
    after that (user code writing to a tensor a save is streaming) must not commit a header that
    lies: the save fails and no step is committed."""
    real = shard_mod.whole_digests

    def then_changed(tensors: list, names: list) -> tuple:
        out = real(tensors, names)
        with torch.no_grad():
            next(t for _, t in tensors if t.is_floating_point() and t.numel()).add_(1.0)
        return out
    monkeypatch.setattr(shard_mod, "whole_digests", then_changed)
    ck = Checkpointer(tmp_path, handle_signals=False)
    with pytest.raises(Exception, match="changed while"):
        ck.save(1, tiny_state(1))
    ck.close()
    assert not list(tmp_path.glob("step_*/COMMITTED")) and not list(tmp_path.glob("step_*"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-rank step the gloo tests below restore, saved once for the module (one xdist group:
    tests/conftest.py); each test restores its own copy."""
    out = tmp_path_factory.mktemp("saved-3-ranks")
    _run(3, "save", out)
    return out / "ck"


@pytest.mark.parametrize("world", [2, 4])
def test_a_resharding_restore_opens_no_index_file(tmp_path: Path, saved: Path, world: int) -> None:
    """3 gloo ranks save one-row pieces (no fine digests: the header's block digests), multi-row
    and Shard(1) pieces and plain tensors; 2 and 4 ranks restore them exactly, each opening only
    shard files (its own, and those its box spans) and the manifest: no index file. The old code
    opened the index of every shard it read."""
    shutil.copytree(saved, tmp_path / "ck", symlinks=True)
    _run(world, "restore", tmp_path)
    for rank in range(world):
        got = json.loads((tmp_path / f"restore-{world}-{rank}.json").read_text())
        assert got["step"] == 1 and got["exact"], got
        assert got["opens"] and not [f for f in got["opens"] if f.endswith(".index.json")], (rank, got["opens"])


def _run(nproc: int, mode: str, tmp_path: Path) -> None:
    from helpers.procs import HELPERS, run_ranks

    res = run_ranks(nproc, HELPERS / "reshard_opens.py", mode, tmp_path, tmp_path / "ck", preload=("torch._dynamo",))
    assert res.returncode == 0, res.stderr[-4000:]


def test_a_flipped_byte_of_a_whole_shard1_piece_is_caught_by_its_stripes(tmp_path: Path, saved: Path) -> None:
    """Restoring 3 -> 2 ranks reads rank 0's whole Shard(1) piece of "col": checked by its fine
    stripes (the only digests outside the index); a flipped byte there fails the restore."""
    shutil.copytree(saved, tmp_path / "ck", symlinks=True)
    d = step_dir(tmp_path / "ck", 1)
    f = "rank-00000-of-00003.safetensors"
    header, start = read_header(d, f, (d / f).stat().st_size)
    raw = bytearray((d / f).read_bytes())
    raw[start + header["col"]["data_offsets"][0] + 5] ^= 0x01
    (d / f).write_bytes(bytes(raw))
    _run(2, "restore", tmp_path)
    for rank in range(2):
        got = json.loads((tmp_path / f"restore-2-{rank}.json").read_text())
        assert "fails its checksum" in got.get("error", ""), got


@pytest.mark.parametrize("keep", [shard_mod.HOST_COPY_KEEP, 0])
def test_a_plain_tensor_whose_bytes_reach_the_host_by_a_copy(tmp_path: Path, keep: int,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a GPU tensor takes (`on_device`), on CPU: copied and hashed before the header is
    built, then streamed (kept) or copied again while streaming (`keep` 0): the same file as the
    host path writes, header digests included."""
    t = {"a": torch.randn(33, 7), "b": torch.arange(5.0)}
    shard_mod.write_shard(tmp_path, "host.safetensors", list(t.items()), {"format": "pt"})
    copies: list[int] = []

    def to_host(x: torch.Tensor) -> torch.Tensor:
        copies.append(x.numel())
        return x.detach().clone()
    monkeypatch.setattr(shard_mod, "on_device", lambda x: True)
    monkeypatch.setattr(shard_mod, "to_host", to_host)
    monkeypatch.setattr(shard_mod.whole_digests, "__defaults__", (keep,))
    shard_mod.write_shard(tmp_path, "device.safetensors", list(t.items()), {"format": "pt"})
    assert (tmp_path / "host.safetensors").read_bytes() == (tmp_path / "device.safetensors").read_bytes()
    assert sorted(copies) == sorted([231, 5] * (1 if keep else 2))

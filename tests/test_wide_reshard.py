"""Issue #33, read amplification of resharded restores: a Shard(1) piece over 16 MiB gets fine
stripes too, and so does a piece whose bytes reach host memory only by a copy (a GPU piece; on
CPU the same path is taken through the `shard.on_device` seam), so a rank restoring on another
world size reads within 5% of the bytes it needs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import xxhash
from helpers.procs import HELPERS, run_ranks

from slurmresume.checkpoint import shard
from slurmresume.checkpoint.reshard import _fine_blocks
from slurmresume.checkpoint.shard import HOST_COPY_KEEP, SKELETON_KEY, fine_width, write_shard
from slurmresume.checkpoint.shardread import read_header
from slurmresume.events import read_events


def _torchrun(nproc: int, *args: str | Path) -> None:
    res = run_ranks(nproc, HELPERS / "wide_reshard.py", *args, timeout=300)  # forked ranks: the launch is not under test
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.slow  # two torchrun starts and ~60 MB saved (~40 s here)
@pytest.mark.parametrize("path", ["host", "late"])
def test_a_wide_shard1_piece_restored_on_two_ranks_reads_what_it_needs(tmp_path: Path, path: str) -> None:
    """Saved on 3 ranks (Shard(1) pieces of 18.3 MiB, Shard(0) pieces of bf16 rows), restored on
    2: each new rank needs half of the middle piece's columns. `late`: every piece is saved the
    way a GPU piece is (its bytes copied to the host after the header's plan)."""
    root = tmp_path / "ck"
    _torchrun(3, "save", root, *(["late"] if path == "late" else []))
    _torchrun(2, "restore", root, tmp_path)
    event = [e for e in read_events(root) if e.get("event") == "restored"][-1]
    for rank in range(2):
        got = json.loads((tmp_path / f"wide-2-{rank}.json").read_text())
        assert got["step"] == 1 and all(got["exact"].values()), got
        assert got["needed"] <= got["bytes"] <= 1.05 * got["needed"], (rank, got)
    assert event["read_ratio_max"] <= 1.05, event


def _write(directory: Path, t: torch.Tensor, dim: int) -> dict[str, tuple[list[str], int, int]]:
    """Write `t` as DTensor piece "w" sharded along `dim`; its header's fine digests."""
    skeleton = {"dtensors": {"w": {"shape": list(t.shape), "offset": [0] * t.ndim, "local_shape": list(t.shape),
                                   "placements": [f"shard:{dim}"], "mesh_shape": [3]}}}
    directory.mkdir(exist_ok=True)
    written = write_shard(directory, "rank-00000-of-00001.safetensors", [("w", t)],
                          {SKELETON_KEY: json.dumps(skeleton)})
    header, _ = read_header(directory, written.file, written.bytes)
    return _fine_blocks(header, directory / written.file)


def _stripes(t: torch.Tensor, width: int) -> list[str]:
    return [xxhash.xxh3_64_hexdigest(t[:, i : i + width].contiguous().numpy().tobytes())
            for i in range(0, t.shape[1], width)]


def test_a_shard1_piece_over_16_mib_gets_column_stripes(tmp_path: Path) -> None:
    """18.3 MiB: the old code skipped it (its column boxes read whole rows). The stripes are the
    row-major bytes of each column range, as for smaller pieces (readers of every version check them)."""
    t = torch.randn(64, 75_000)
    fine = _write(tmp_path, t, 1)
    width = fine_width([64, 75_000], 4, 1)
    assert fine == {"w": (_stripes(t, width), 1, width)} and width == 1172


@pytest.mark.parametrize("keep", [HOST_COPY_KEEP, 0])
def test_a_piece_whose_bytes_reach_the_host_by_a_copy_gets_fine_digests(tmp_path: Path, keep: int,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a GPU piece takes (`on_device`), on CPU: the copy is made and hashed before the
    header is built, then streamed (kept), or copied again while streaming (`keep` 0). The file
    holds the same bytes and the header the same stripes as the host path's."""
    copies: list[int] = []

    def to_host(t: torch.Tensor) -> torch.Tensor:
        copies.append(t.numel())
        return t.detach().clone()

    t, rows = torch.randn(37, 1000).to(torch.bfloat16), torch.randn(1000, 24)
    want = {"cols": _write(tmp_path / "a", t, 1), "rows": _write(tmp_path / "b", rows, 0)}
    monkeypatch.setattr(shard, "on_device", lambda t: True)
    monkeypatch.setattr(shard, "to_host", to_host)
    monkeypatch.setattr(shard.fine_digests, "__defaults__", (keep,))
    got = {"cols": _write(tmp_path / "c", t, 1), "rows": _write(tmp_path / "d", rows, 0)}
    assert got == want and want["cols"]["w"][1:] == (1, 16) and want["rows"]["w"][1:] == (0, 16)
    assert copies == [t.numel()] * (1 if keep else 2) + [rows.numel()] * (1 if keep else 2)
    for a, b in (("a", "c"), ("b", "d")):
        assert (tmp_path / a / "rank-00000-of-00001.safetensors").read_bytes() == (
            tmp_path / b / "rank-00000-of-00001.safetensors").read_bytes()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("keep", [HOST_COPY_KEEP, 0])
def test_a_piece_saved_from_the_gpu_gets_the_fine_digests_of_its_host_bytes(tmp_path: Path, keep: int,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The real device path (no seam): a CUDA piece's header holds the same stripes, and the file
    the same bytes, as the same piece saved from host memory."""
    monkeypatch.setattr(shard.fine_digests, "__defaults__", (keep,))
    for dim, t in ((1, torch.randn(37, 1000).to(torch.bfloat16)), (0, torch.randn(1000, 24))):
        want, got = _write(tmp_path / f"h{dim}", t, dim), _write(tmp_path / f"d{dim}", t.cuda(), dim)
        assert got == want and want["w"][2] == 16
        assert (tmp_path / f"h{dim}" / "rank-00000-of-00001.safetensors").read_bytes() == (
            tmp_path / f"d{dim}" / "rank-00000-of-00001.safetensors").read_bytes()

"""DTensor / FSDP2 checkpoints: saved as local pieces with global offsets, restored on another
number of ranks or another sharding by reading only the byte ranges each rank needs, exported
as one consolidated file, and hostile offsets refused."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from helpers.core import edit_rows
from helpers.procs import HELPERS, run_ranks
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from typer.testing import CliRunner

import slurmresume
from slurmresume.checkpoint import reshard
from slurmresume.checkpoint.sharding import Piece, Sharded, cover, runs
from slurmresume.cli import app
from slurmresume.errors import CorruptCheckpointError

# One worker runs this module, so that its module-scoped fixture (a multi-process run) is
# computed once: under xdist each worker that got one of its tests computed it again.
pytestmark = pytest.mark.xdist_group("reshard")

WORKER = HELPERS / "reshard_train.py"
STEP = "step_000000003"


def _ranks(nproc: int, *args: str | Path) -> None:
    """reshard_train.py as `nproc` gloo ranks forked from one warmed process (helpers/forkranks.py):
    the launch is not under test; torch._dynamo (AdamW imports it) is imported once."""
    res = run_ranks(nproc, WORKER, *args, timeout=240, preload=("torch._dynamo",))
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(out dir with full.safetensors, checkpoint root): FSDP2 (Shard(0)) + AdamW on 2 ranks."""
    out = tmp_path_factory.mktemp("reshard")
    _ranks(2, "save", out, out / "ck")
    return out, out / "ck"


def _resume(out: Path, root: Path, world: int, dim: int, *extra: str | Path) -> list[dict]:
    _ranks(world, "resume", out, root, "--dim", str(dim), *extra)
    return [json.loads((out / f"resume-{world}-{dim}-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def baseline(saved: tuple[Path, Path]) -> list[str]:
    """The un-resharded continuation: the same 2 ranks, the same sharding."""
    results = _resume(*saved, 2, 0)
    assert results[0]["mismatch"] == [] and results[0]["losses"] == results[0]["ref_losses"]
    return results[0]["losses"]


@pytest.mark.slow
def test_manifest_records_global_offsets(saved: tuple[Path, Path]) -> None:
    manifest = json.loads((saved[1] / STEP / "manifest.json").read_text())  # format 2: each rank's own index
    pieces = {(n, r): {**t, "replicated": r == 0 and n in manifest["replicated"]} for r in (0, 1)
              for n, t in json.loads((saved[1] / STEP / f"rank-0000{r}.index.json").read_text())["tensors"].items()}
    assert manifest["sharded"]["model/0.weight"] == {"dtype": "F32", "shape": [32, 16], "placements": ["shard:0"],
                                                    "mesh_shape": [2], "mesh_arange": True}
    assert pieces["model/0.weight", 0]["global_offset"] == [0, 0]
    assert pieces["model/0.weight", 1]["global_offset"] == [16, 0]
    assert pieces["model/0.weight", 1]["shape"] == [16, 16] and pieces["model/0.weight", 1]["global_shape"] == [32, 16]
    assert pieces["optim/state/0/exp_avg", 1]["global_offset"] == [16, 0]  # AdamW state of a DTensor param
    # equal bytes at different offsets are pieces, not replicas; a Replicate() DTensor is stored once
    assert ("extra/ones", 1) in pieces and not pieces["extra/ones", 0].get("replicated")
    assert pieces["extra/rep", 0]["replicated"] and ("extra/rep", 1) not in pieces


@pytest.mark.slow
@pytest.mark.parametrize("world,dim", [(1, 0), (4, 0), (2, 1)])
def test_restore_on_another_world_or_sharding(saved: tuple[Path, Path], baseline: list[str], tmp_path: Path,
                                              world: int, dim: int) -> None:
    out, root = saved
    save_to = ("--save-to", tmp_path / "again") if dim == 1 else ()
    results = _resume(out, root, world, dim, *save_to)
    for r in results:
        assert r["step"] == 3 and r["mismatch"] == [], r  # full_tensor() of every tensor bitwise equal
        assert r["extra_type"] == "DTensor"
        assert r["losses"] == r["ref_losses"]  # bitwise: same as a load by distribute_tensor of the full state
        # every rank trains on the same batch, so the gradient reduction is exact for 1, 2 and 4
        # ranks and the continuation equals the 2-rank one bitwise (3 ranks: see README)
        assert r["losses"] == baseline
    if dim == 1:
        assert "(Shard(dim=1),)" in results[0]["placements"]
        _check_export(tmp_path / "again", out)  # pieces that are column blocks, assembled


def _check_export(root: Path, out: Path) -> None:
    dest = root.parent / "export.safetensors"
    res = CliRunner().invoke(app, ["export", "latest", "--ckpt-dir", str(root), "--out", str(dest)])
    assert res.exit_code == 0, res.output
    got, full = load_file(str(dest)), load_file(str(out / "full.safetensors"))
    assert set(got) == {k.removeprefix("model/") for k in full if k.startswith("model/")}
    for k, v in got.items():
        assert torch.equal(v, full[f"model/{k}"]), k
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 8))
    model.load_state_dict(got, strict=True)


@pytest.mark.slow
def test_export_consolidates_dtensor_checkpoint(saved: tuple[Path, Path]) -> None:
    _check_export(saved[1], saved[0])


@pytest.mark.slow
def test_reshard_4_to_2_reads_only_its_share(tmp_path: Path) -> None:
    _ranks(4, "bytes", tmp_path, tmp_path / "ck")
    _ranks(2, "bytes", tmp_path, tmp_path / "ck")
    for rank in (0, 1):
        info = json.loads((tmp_path / f"bytes-2-0-{rank}.json").read_text())
        assert info["ok"]
        assert info["bytes"] == info["total"] // 2  # exactly its half: two whole old pieces per tensor
        assert info["reads"] == 2 * 4  # one contiguous pread per old piece


def test_restore_without_dtensors_in_state_gives_global_tensors(saved: tuple[Path, Path]) -> None:
    state: dict = {"extra": None}
    step = slurmresume.Checkpointer(saved[1], handle_signals=False).restore(state, step=3, strict=False,
                                                                             restore_rng=False)
    full = load_file(str(saved[0] / "full.safetensors"))
    assert step == 3 and torch.equal(state["extra"]["ones"], full["extra/ones"])
    assert torch.equal(state["extra"]["rep"], full["extra/rep"])


def _edit(root: Path, name: str, edits: dict[int, dict]) -> None:
    """Change the index entries of `name` ({rank: changes}, rank -1: every rank), re-seal the
    index digests in the manifest and the manifest's in the marker."""
    d = root / STEP
    manifest = json.loads((d / "manifest.json").read_text())

    def reseal(m: dict) -> None:
        for rank, shard in enumerate(m["shards"]):
            index = json.loads((d / shard["index"]).read_text())
            if name in index["tensors"]:
                index["tensors"][name].update({**edits.get(-1, {}), **edits.get(rank, {})})
            raw = json.dumps(index).encode()
            (d / shard["index"]).write_bytes(raw)
            shard.update(index_bytes=len(raw), index_xxh3=xxhash.xxh3_64_hexdigest(raw))
    edit_rows(manifest, reseal)
    raw = json.dumps(manifest).encode()
    (d / "manifest.json").write_bytes(raw)
    (d / "COMMITTED").write_text(json.dumps({"step": 3, "manifest_xxh3": xxhash.xxh3_64_hexdigest(raw)}))


@pytest.mark.parametrize("rank,changes,message", [
    (1, {"global_offset": [6, 0]}, "outside its global shape"),
    (1, {"global_offset": [-1, 0]}, "not a list of non-negative integers"),
    (1, {"global_offset": [1.5, 0]}, "not a list of non-negative integers"),
    (1, {"global_offset": ["4", 0]}, "not a list of non-negative integers"),
    (1, {"global_offset": [True, 0]}, "not a list of non-negative integers"),
    (1, {"global_offset": [4]}, "different numbers of dimensions"),
    (1, {"global_shape": [8, 1 << 41]}, "non-negative integers"),
    (1, {"global_shape": [9, 4]}, "disagree"),
])  # (format 1's "rank" field of an entry, pointing at another rank, has no format-2 counterpart)
def test_hostile_manifest_offsets_refused_before_reading(saved: tuple[Path, Path], tmp_path: Path, rank: int,
                                                         changes: dict, message: str) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved[1], root)
    _edit(root, "extra/ones", {rank: changes})
    reshard.STATS.update(bytes=0, reads=0)
    with pytest.raises(CorruptCheckpointError, match=message):  # verifying: rank 0 checks every index first
        slurmresume.Checkpointer(root, handle_signals=False, verify_on_restore=True).restore(
            {"extra": None}, step=3, strict=False)
    assert reshard.STATS["bytes"] == 0
    _index_not_needed(saved, root)


def _index_not_needed(saved: tuple[Path, Path], root: Path) -> None:
    """A restore by default opens no index file: the pieces' boxes come from the manifest's
    placements and every digest it checks from the shard headers (verified against the
    manifest), so a hostile index leaves it untouched (the restore is exact); `verify` and a
    verifying restore refuse the step."""
    state: dict = {"extra": None}
    assert slurmresume.Checkpointer(root, handle_signals=False).restore(state, step=3, strict=False,
                                                                         restore_rng=False) == 3
    full = load_file(str(saved[0] / "full.safetensors"))
    assert torch.equal(state["extra"]["ones"], full["extra/ones"])
    res = CliRunner().invoke(app, ["verify", "--ckpt-dir", str(root), "--all"], terminal_width=200)
    assert res.exit_code != 0, res.output


@pytest.mark.parametrize("edits,message", [  # format 2: each index is checked against the manifest's placements
    ({1: {"global_offset": [2, 0]}}, "disagrees with the placements"),  # (format 1: "overlap")
    ({-1: {"global_shape": [12, 4]}}, "disagree"),  # (format 1: "do not cover")
    ({0: {"shape": [5, 4]}, 1: {"shape": [3, 4], "global_offset": [5, 0]}}, "disagrees with the placements"),
])
def test_inconsistent_pieces_refused_at_read(saved: tuple[Path, Path], tmp_path: Path, edits: dict,
                                             message: str) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved[1], root)
    _edit(root, "extra/ones", edits)
    with pytest.raises(CorruptCheckpointError, match=message):
        slurmresume.Checkpointer(root, handle_signals=False, verify_on_restore=True).restore(
            {"extra": None}, step=3, strict=False)
    _index_not_needed(saved, root)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=3).flatmap(
    lambda shape: st.tuples(st.just(shape), *[st.tuples(st.integers(0, d - 1), st.integers(0, d - 1))
                                              for d in shape])))
def test_runs_are_exactly_the_box(case: tuple) -> None:
    """The byte runs `runs()` gives for a box of a piece are the box's elements, in order."""
    shape, *bounds = case
    rel = tuple(min(a, b) for a, b in bounds)
    box = tuple(abs(a - b) + 1 for a, b in bounds)
    flat = np.arange(math.prod(shape)).reshape(shape)
    length, starts = runs(tuple(shape), rel, box)
    got = np.concatenate([flat.reshape(-1)[s:s + length] for s in starts])
    assert got.tolist() == flat[tuple(slice(r, r + n) for r, n in zip(rel, box))].reshape(-1).tolist()


def test_cover_tiles_a_box_from_uneven_pieces() -> None:
    pieces = (Piece(0, (0, 0), (11, 4)), Piece(1, (11, 0), (11, 4)), Piece(2, (22, 0), (10, 4)))
    tensor = Sharded("w", "F32", (32, 4), pieces)
    hits = cover(tensor, (8, 0), (16, 4))  # rows 8..24 of a 3-rank save, as rank 1 of 2 needs them
    assert [(p.rank, lo, sh) for p, lo, sh in hits] == [(0, (8, 0), (3, 4)), (1, (11, 0), (11, 4)),
                                                         (2, (22, 0), (2, 4))]
    assert cover(tensor, (0, 0), (0, 4)) == []

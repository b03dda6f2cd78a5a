"""Format 2: a small manifest (per shard: sizes and checksums of the shard and of its rank's index
file; each DTensor once) and per-rank index files covered by the manifest's checksum."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.core import model_equal, save_steps, shard_rows, step_dir, tiny_model, tiny_state
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MANIFEST
from slurmresume.checkpoint.store import inspect_dir
from slurmresume.cli import app
from slurmresume.errors import CorruptCheckpointError

INDEX = "rank-00000.index.json"


def test_the_manifest_lists_no_tensor_of_any_rank(tmp_path: Path) -> None:
    save_steps(tmp_path, [1]).close()
    manifest = json.loads((step_dir(tmp_path, 1) / MANIFEST).read_text())
    index = json.loads((step_dir(tmp_path, 1) / INDEX).read_text())
    assert manifest["format"] == "slurmresume/3" and "tensors" not in manifest
    assert [s["index"] for s in shard_rows(manifest)] == [INDEX]
    assert "model/0.weight" in index["tensors"] and index["tensors"]["model/0.weight"]["xxh3"]
    assert index["rank"] == 0 and index["file"] == shard_rows(manifest)[0]["file"]


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


def test_a_flipped_index_byte_fails_verify_and_restore_falls_back(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2]).close()
    index = step_dir(tmp_path, 2) / INDEX
    _flip(index, index.read_bytes().index(b'"xxh3":["') + 10)  # a digit of a block digest
    info = inspect_dir(2, step_dir(tmp_path, 2), verify=True)
    assert not info.complete and "tensor index" in (info.problem or "") and "fails its checksum" in info.problem
    res = CliRunner().invoke(app, ["verify", "--ckpt-dir", str(tmp_path), "--all"], terminal_width=200)
    assert res.exit_code != 0
    _restores_without_the_index(tmp_path)


def _restores_without_the_index(root: Path) -> None:
    """Step 2's index is damaged or gone, its shard intact: a restore, which reads every digest it
    checks from the shard header (verified against the manifest) and opens no index, loads step 2
    exactly; a verifying restore (rank 0 checks every file first) falls back to step 1. The old
    code fell back to step 1 either way."""
    state = tiny_state(987654)
    with Checkpointer(root, handle_signals=False) as ck:
        assert ck.restore(state) == 2
    assert model_equal(state["model"], tiny_model(2))
    state = tiny_state(987654)
    with Checkpointer(root, handle_signals=False, verify_on_restore=True) as ck:
        assert ck.restore(state) == 1
    assert model_equal(state["model"], tiny_model(1))


def test_a_missing_index_makes_the_step_incomplete(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2]).close()
    (step_dir(tmp_path, 2) / INDEX).unlink()
    info = inspect_dir(2, step_dir(tmp_path, 2))
    assert not info.complete and info.has_marker and not info.unreadable and INDEX in (info.problem or "")
    _restores_without_the_index(tmp_path)


def test_an_index_of_another_rank_is_refused(tmp_path: Path) -> None:
    """An index file that matches its digest but claims another rank (or file) is never used."""
    save_steps(tmp_path, [1]).close()
    info = inspect_dir(1, step_dir(tmp_path, 1))
    assert info.manifest is not None
    shard = {**info.manifest.shards[0], "rank": 1}
    from slurmresume.checkpoint.rankindex import read_index

    with pytest.raises(CorruptCheckpointError, match="not rank 1's index"):
        read_index(step_dir(tmp_path, 1), shard)


def _collectives_run(tmp_path: Path, world: int = 3) -> list[dict]:
    from helpers.procs import HELPERS, run_ranks

    out = tmp_path / "out"
    out.mkdir()
    res = run_ranks(world, HELPERS / "scale_collectives.py", out, tmp_path / "ck")  # forked ranks: the launch is not under test
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def collectives(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _collectives_run(tmp_path_factory.mktemp("collectives"))


def test_the_save_gathers_fixed_records_and_never_all_gathers(collectives: list[dict]) -> None:
    """3 ranks, a Shard(0) DTensor, a Replicate() one, a replicated and a per-rank plain tensor:
    no all_gather during the save (the old save all-gathered every rank's tensor index and the
    digests of every tensor); rank 0 gathers records, the outcome is broadcast."""
    for r in collectives:
        assert r["step"] == 1 and r["exact"], r
        assert not [c for c in r["calls"] if c.startswith("all_gather")], r["calls"]
        assert "gather" in r["calls"] and "broadcast" in r["calls"]


def test_a_same_world_restore_opens_only_its_own_files_and_rank_0s(collectives: list[dict]) -> None:
    """Placement-aware restore: rank r reads its own shard (and rank 0's, where the replicated
    tensors are stored), and no index file: every digest it checks is in the shard headers it
    reads (shard.BLOCKS_KEY, FINE_KEY); only rank 0 checks every file's size. The old code had
    every rank open every shard after the restore (inspect_dir), and rank 0 read every index;
    then each rank opened its own index and rank 0's."""
    own = {1: {"rank-00001-of-00003.safetensors"}, 2: {"rank-00002-of-00003.safetensors"}}
    first = {"rank-00000-of-00003.safetensors", "manifest.json", "COMMITTED"}
    for rank in (1, 2):
        opened = set(collectives[rank]["opens"])
        assert own[rank] <= opened and opened <= own[rank] | first, (rank, sorted(opened))
    assert not [f for r in collectives for f in r["opens"] if f.endswith(".index.json")], collectives[0]["opens"]


def test_only_rank_0_opens_the_manifest_once_per_restore(collectives: list[dict]) -> None:
    """Rank 0 reads marker and manifest once, when it chooses the step, and plans from that parse;
    every other rank parses the manifest's bytes rank 0 broadcast (checked against the digest it
    pinned) and opens neither file. Older code read the manifest once on every rank (before that,
    twice on ranks 1 and 2 and three times on rank 0)."""
    for rank, r in enumerate(collectives):
        assert r["opens"].count("manifest.json") == (1 if rank == 0 else 0), (rank, r["opens"])
        assert r["opens"].count("COMMITTED") == (1 if rank == 0 else 0), (rank, r["opens"])


def test_a_rank_opens_each_file_once_per_restore(collectives: list[dict]) -> None:
    """The fds the plan opened (each shard checked by `open_checked`, its header checked against
    the manifest) are kept for the read: one open per file per restore. The old code opened a
    rank's own shard three times (the plan's header, the whole tensors, the DTensor boxes) and
    four on rank 0."""
    for rank, r in enumerate(collectives):
        assert r["step"] == 1 and r["exact"], r
        opened = [f for f in r["opens"] if f != "COMMITTED"]
        assert opened and all(opened.count(f) == 1 for f in opened), (rank, r["opens"])


def test_a_same_world_rank_builds_only_its_own_shard_row_and_rank_0s(collectives: list[dict]) -> None:
    """Format 3 stores the shard table as columns: a restoring rank's parse makes no per-shard
    object, and its plan builds the rows of the shards it reads (its own; rank 0's, where the
    replicated tensors are), no other. The old format parsed one dict per shard on every rank."""
    for rank, r in enumerate(collectives):
        assert r["rows_built"] is not None and set(r["rows_built"]) <= {0, rank}, (rank, r["rows_built"])


@pytest.mark.parametrize(("shape", "mesh", "placements"), [
    ((12, 4), (3,), ("shard:0",)), ((10, 7), (4,), ("shard:1",)), ((2, 5), (4,), ("shard:0",)),
    ((9, 6), (2, 3), ("shard:0", "shard:1")), ((9, 6), (2, 3), ("replicate", "shard:0")),
    ((13, 5), (2, 3), ("shard:0", "shard:0")), ((8,), (2, 2), ("replicate", "replicate")),
])
def test_holders_match_torchs_placement_rule(shape: tuple, mesh: tuple, placements: tuple) -> None:
    """Every rank's piece computed by `placement.holders` is the one torch gives its coordinate,
    and a box is tiled exactly by the pieces found (the lowest rank of replicated coordinates)."""
    import itertools
    import math

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from slurmresume.checkpoint.sharding import Sharded

    def holders(shape: tuple, mesh: tuple, placements: tuple, offset: tuple, box: tuple) -> tuple:
        return Sharded("t", "F32", shape, (), (mesh, placements)).pieces_in(offset, box)

    torch_placements = [Replicate() if p == "replicate" else Shard(int(p[6:])) for p in placements]
    everything = holders(shape, mesh, placements, (0,) * len(shape), shape)
    assert sum(math.prod(p.shape) for p in everything) == math.prod(shape)
    for p in everything:
        coord = list(itertools.product(*map(range, mesh)))[p.rank]
        local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), torch_placements)
        assert (tuple(local), tuple(offset)) == (p.shape, p.offset)
    box_lo = tuple(d // 3 for d in shape)
    box = tuple(max(1, d // 2) for d in shape)
    found = holders(shape, mesh, placements, box_lo, box)
    assert {p.rank for p in found} == {p.rank for p in everything
                                       if all(o < bl + b and bl < o + s for o, s, bl, b in zip(p.offset, p.shape,
                                                                                               box_lo, box))}


def test_local_box_is_torchs_rule_for_every_coordinate_empty_pieces_included() -> None:
    """`placement.local_box` (the restore plan's arithmetic, in place of torch's ~30 us call per
    DTensor) gives every coordinate the (offset, shape) torch gives it, on 1-3-D meshes, with
    uneven and empty pieces and a dimension sharded twice (torch puts an empty piece at the end)."""
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from slurmresume.checkpoint.placement import local_box

    cases = 0
    for shape in [(12, 4), (10, 7), (2, 5), (13, 5), (8,), (1, 3), (0, 4)]:
        for mesh in [(3,), (5,), (2, 3), (2, 2, 2)]:
            kinds = ["replicate"] + [f"shard:{d}" for d in range(len(shape))]
            for placements in itertools.product(kinds, repeat=len(mesh)):
                theirs = [Replicate() if p == "replicate" else Shard(int(p[6:])) for p in placements]
                for coord in itertools.product(*map(range, mesh)):
                    local, offset = _compute_local_shape_and_global_offset(shape, mesh, list(coord), theirs)
                    assert local_box(shape, mesh, coord, placements) == (tuple(offset), tuple(local)), \
                        (shape, mesh, placements, coord)
                    cases += 1
    assert cases > 1000


def test_a_dtensor_rank_0_does_not_hold_is_restored_by_its_listed_pieces(tmp_path: Path) -> None:
    """3 gloo ranks; a Shard(0) DTensor on a mesh over ranks [1, 2] (a pipeline stage's), which the
    manifest's once-per-tensor section (rank 0's) cannot list. Restored as Shard(1) on the same
    ranks, each rank's box spans both saved pieces. The old code took its pieces for plain tensors
    of each rank's own shard and loaded wrong values on ranks 1 and 2 without an error; now a
    rank's record says it holds such a piece, the manifest says "pieces_listed", and the pieces
    come from the index files."""
    from helpers.procs import HELPERS, run_ranks

    out = tmp_path / "out"
    out.mkdir()
    for mode in ("save", "restore"):  # forked ranks: the launch is not under test
        res = run_ranks(3, HELPERS / "submesh_restore.py", out, tmp_path / "ck", mode)
        assert res.returncode == 0, res.stderr[-4000:]
    for rank in range(3):
        r = json.loads((out / f"{rank}.json").read_text())
        assert r == {"step": 1, "exact": True, "error": None}, (rank, r)
    manifest = json.loads((step_dir(tmp_path / "ck", 1) / MANIFEST).read_text())
    assert manifest["sharded"] == {} and manifest.get("pieces_listed") is True

"""A resharding restore that opens each saved shard once (checkpoint/exchange.py): the plans of
every rank, worked out without a process group, tile each rank's box exactly and agree pair by
pair; real gloo ranks restore exactly with it, open fewer shards, and fail together."""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers.procs import HELPERS, clean_env, run_ranks
from torch.distributed.tensor import Replicate, Shard

from slurmresume.checkpoint import exchange
from slurmresume.checkpoint.boxes import Target, placement_kinds
from slurmresume.checkpoint.placement import local_box
from slurmresume.checkpoint.sharding import Sharded, cover
from slurmresume.errors import ConfigError


class Mesh:
    """What exchange.plan asks of a DeviceMesh: its ranks by coordinate and its shape."""

    def __init__(self, shape: tuple[int, ...], order: list[int] | None = None) -> None:
        n = math.prod(shape)
        self.mesh = torch.tensor(order if order is not None else list(range(n))).reshape(shape)
        self.shape = shape

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return tuple(int(c) for c in (self.mesh == rank).nonzero()[0])


def _world(saved: tuple[tuple[int, ...], tuple[str, ...]], mesh: Mesh, placements: list,
           shapes: dict[str, tuple[int, ...]], world: int) -> dict[int, exchange.Plan]:
    """Every restoring rank's exchange plan (boxes by torch's rule, as boxes.plan_reads makes them)."""
    index = {n: Sharded(n, "F32", s, (), layout=saved) for n, s in shapes.items()}
    where = {n: Target(mesh, placements, None) for n in shapes}
    kinds = placement_kinds(tuple(placements))
    plans = {}
    for rank in range(world):
        coord = mesh.coordinate(rank)
        boxes = {}
        for n, s in shapes.items():
            offset, shape = local_box(s, mesh.shape, coord, kinds)
            boxes[n] = (shape, offset)
        got = exchange.plan(rank, world, math.prod(saved[0]), index, where, boxes)
        assert got is not None
        plans[rank] = got
    return plans


CASES = {
    # saved 1-D Shard(0) (FSDP2), restored on fewer / more ranks; uneven rows (torch's ceil chunks)
    "16->12": (((16,), ("shard:0",)), Mesh((12,)), [Shard(0)], 12),
    "12->16": (((12,), ("shard:0",)), Mesh((16,)), [Shard(0)], 16),
    "7->3": (((7,), ("shard:0",)), Mesh((3,)), [Shard(0)], 3),
    # onto a 2-D mesh (HSDP-like: replicate x shard), and one whose ranks are not in row-major order
    "6->2x3 replicate": (((6,), ("shard:0",)), Mesh((2, 3)), [Replicate(), Shard(0)], 6),
    "4->2x2 shard(0),shard(1) permuted": (((4,), ("shard:0",)), Mesh((2, 2), [3, 1, 2, 0]), [Shard(0), Shard(1)], 4),
    # saved on a 2-D mesh with a replicated dimension (the lowest holder's shard is read)
    "2x3 replicate -> 4": (((2, 3), ("replicate", "shard:0")), Mesh((4,)), [Shard(0)], 4),
}
SHAPES = {"a": (37, 5), "b": (12, 8), "c": (5, 3), "d": (1, 4), "e": (64,)}


@pytest.mark.parametrize("case", CASES)
def test_every_ranks_chunks_tile_its_box_and_each_message_is_planned_the_same_on_both_ends(case: str) -> None:
    saved, mesh, placements, world = CASES[case]
    shapes = {n: s for n, s in SHAPES.items() if len(s) >= sum(1 for p in placements if p == Shard(1)) + 1}
    plans = _world(saved, mesh, placements, shapes, world)
    kinds = placement_kinds(tuple(placements))
    saved_world = math.prod(saved[0])
    owned = sorted(s for p in plans.values() for s in p.owned)
    assert owned == sorted(set(owned)) and set(owned) <= set(range(saved_world))  # one reader a saved shard at most
    for rank, p in plans.items():
        for q, chunks in p.send.items():  # what rank sends q is what q expects from rank, in order
            assert plans[q].recv.get(rank) == chunks, (case, rank, q)
        for o, chunks in p.recv.items():
            assert plans[o].send.get(rank) == chunks, (case, o, rank)
        coord = mesh.coordinate(rank)
        for name, shape in shapes.items():
            offset, box = local_box(shape, mesh.shape, coord, kinds)
            mine = [c for c in p.local + [c for cs in p.recv.values() for c in cs] if c[0] == name]
            assert sum(math.prod(c[2]) for c in mine) == math.prod(box), (case, rank, name)
            marks = torch.zeros(box, dtype=torch.int32)
            for _, lo, sh in mine:
                marks[tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, offset, sh))] += 1
            assert bool((marks == 1).all()), (case, rank, name)  # every element once: no gap, no overlap
    assert len({p.digest for p in plans.values()}) == 1


def test_1024_saved_ranks_onto_768_with_the_row_counts_of_405b() -> None:
    """The row counts whose ceil chunks give one rank's boxes ~5 saved shards at 16,384 -> 12,288
    (405B: 16,384, 1,024, 53,248 and 128,256 rows), at 1,024 -> 768 ranks, every rank's plan made
    as it would be (no process group): the chunks tile every box, each message is planned the
    same on both ends, and each saved shard is read by one rank."""
    saved, mesh, world = ((1024,), ("shard:0",)), Mesh((768,)), 768
    shapes = {"wq": (16384, 2), "wk": (1024, 2), "w1": (53248, 2), "emb": (128256, 2)}
    plans = _world(saved, mesh, [Shard(0)], shapes, world)
    for rank, p in plans.items():
        for q, chunks in p.send.items():
            assert plans[q].recv.get(rank) == chunks, (rank, q)
        for name, shape in shapes.items():
            offset, box = local_box(shape, (world,), (rank,), ("shard:0",))
            mine = sorted((lo, sh) for n, lo, sh in p.local + [c for cs in p.recv.values() for c in cs] if n == name)
            rows = [(lo[0], lo[0] + sh[0]) for lo, sh in mine]
            assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])), (rank, name, rows)  # contiguous, no overlap
            assert (rows[0][0], rows[-1][1]) == (offset[0], offset[0] + box[0]) if box[0] else not rows
    assert sorted(s for p in plans.values() for s in p.owned) == list(range(1024))
    assert max(len(p.recv) for p in plans.values()) >= 3  # the boxes do span several owners


def test_each_saved_shard_has_one_reader_the_rank_that_needs_most_of_it() -> None:
    """Each saved shard is read by one rank, the one that takes the most of its bytes (ties: the
    lowest rank), and a rank reads only the shards it owns: 16 -> 12 ranks, shapes whose chunks
    move by different ratios."""
    saved, mesh, placements, world = CASES["16->12"]
    plans = _world(saved, mesh, placements, SHAPES, world)
    index = {n: Sharded(n, "F32", s, (), layout=saved) for n, s in SHAPES.items()}
    for rank, p in plans.items():  # chunks sent or kept come from the owner's shards only
        for name, lo, shape in p.local + [c for cs in p.send.values() for c in cs]:
            assert {piece.rank for piece, _, _ in cover(index[name], lo, shape)} <= set(p.owned), (rank, name)
    owners = {s: r for r, p in plans.items() for s in p.owned}
    assert sorted(itertools.chain.from_iterable(p.owned for p in plans.values())) == list(range(16))
    for s, o in owners.items():  # bytes of shard s each rank takes, from its own plan
        took = {r: sum(math.prod(c[2]) for c in p.local + [c for cs in p.recv.values() for c in cs]
                       if {pc.rank for pc, _, _ in cover(index[c[0]], c[1], c[2])} == {s})
                for r, p in plans.items()}
        assert took[o] == max(took.values()) and o == min(r for r, n in took.items() if n == took[o]), (s, o, took)


def test_the_inputs_every_rank_must_share_change_the_digest() -> None:
    saved, mesh, placements, world = CASES["16->12"]
    a = _world(saved, mesh, placements, SHAPES, world)[0].digest
    b = _world(saved, mesh, placements, {**SHAPES, "e": (65,)}, world)[0].digest
    c = _world(saved, Mesh((12,), list(range(11, -1, -1))), placements, SHAPES, world)[0].digest
    assert len({a, b, c}) == 3 and all(0 <= d < 2 ** 62 for d in (a, b, c))


def test_specs_the_exchange_does_not_serve_give_no_plan() -> None:
    mesh = Mesh((4,))
    boxes = {"a": ((2, 2), (0, 0))}
    listed = {"a": Sharded("a", "F32", (8, 2), ())}  # pieces listed, not placed by arithmetic
    assert exchange.plan(0, 4, 2, listed, {"a": Target(mesh, [Shard(0)], None)}, boxes) is None
    placed = {"a": Sharded("a", "F32", (8, 2), (), layout=((2,), ("shard:0",)))}
    assert exchange.plan(0, 4, 2, placed, {"a": Target(None, None, None)}, boxes) is None  # a plain target
    assert exchange.plan(0, 4, 2, placed, {"a": Target(Mesh((2,)), [Shard(0)], None)}, boxes) is None  # a sub-mesh
    assert exchange.plan(0, 4, 2, placed, {"a": Target(mesh, [Shard(0)], None)}, boxes) is not None  # the control


@pytest.mark.parametrize(("value", "world", "want"), [(None, 63, "off"), (None, 64, "auto"), ("auto", 4096, "auto"),
                                                      ("1", 2, "on"), (" 0 ", 16384, "off")])
def test_wanted(value: str | None, world: int, want: str) -> None:
    assert exchange.wanted(value, world) == want


@pytest.mark.parametrize(("opens", "world", "worth"), [(3 * 12288, 12288, False), (3 * 12288 + 1, 12288, True),
                                                       (73409, 12288, True), (33654, 12288, False), (64, 64, False)])
def test_auto_takes_the_exchange_only_where_ranks_would_open_over_3_shards_each(opens: int, world: int,
                                                                                 worth: bool) -> None:
    """405B / 7B at 16,384 -> 12,288 (reading their own boxes: 5.97 / 2.74 files a rank)."""
    assert exchange.worth_it(opens, world) is worth


def test_a_bad_setting_is_one_clear_line() -> None:
    with pytest.raises(ConfigError, match="SLURMRESUME_RESHARD_EXCHANGE='yes'"):
        exchange.wanted("yes", 8)


# -- real gloo ranks (tests/helpers/reshard_opens.py: 3 ranks save, 2 or 4 restore) -------------------


def _run(nproc: int, mode: str, tmp_path: Path, **env: str) -> str:
    res = run_ranks(nproc, HELPERS / "reshard_opens.py", mode, tmp_path, tmp_path / "ck",
                    env={**clean_env(), **env}, preload=("torch._dynamo",))
    assert res.returncode == 0, res.stderr[-4000:]
    return res.stderr


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 3-rank step every gloo test below restores, saved once for the module (one xdist group:
    tests/conftest.py); each test restores its own copy."""
    out = tmp_path_factory.mktemp("saved-3-ranks")
    _run(3, "save", out)
    return out / "ck"


def _copy(saved: Path, tmp_path: Path) -> None:
    shutil.copytree(saved, tmp_path / "ck", symlinks=True)


def _shards(opens: list[str]) -> set[int]:
    return {int(f[5:10]) for f in opens if f.endswith(".safetensors")}


# Staged on 4 ranks and in two passes on 2 in the default lane: each world and each way once; the
# other two points with `bash scripts/test --exhaustive`.
@pytest.mark.parametrize(("staging", "world"), [("", 4), ("0", 2), pytest.param("", 2, marks=pytest.mark.exhaustive),
                                                pytest.param("0", 4, marks=pytest.mark.exhaustive)])
def test_gloo_ranks_restore_exactly_each_opening_only_its_own_shard_shard_0_and_those_it_owns(
        tmp_path: Path, saved: Path, world: int, staging: str) -> None:
    """3 gloo ranks save DTensors split by rows (one row and several a rank) and by columns; 2 and
    4 ranks restore them with the exchange forced on, staged and (a staging budget of 0) in two
    passes, verify then live: every tensor exact, and rank r opens only shard r % 3 (its header),
    shard 0 (the replicated plain tensor) and the shards it owns, each owned by one rank. Without
    the exchange, rank 1 of 2 and rank 2 of 4 open shard 2 besides another rank."""
    _copy(saved, tmp_path)
    log = _run(world, "restore", tmp_path, SLURMRESUME_RESHARD_EXCHANGE="1", SLURMRESUME_RESTORE_STAGING_BYTES=staging)
    assert "each saved shard opened by one rank and sent" in log, log[-3000:]
    for rank in range(world):
        got = json.loads((tmp_path / f"restore-{world}-{rank}.json").read_text())
        assert got["step"] == 1 and got["exact"], (rank, got)
    _one_reader_a_shard(tmp_path, world)


def _one_reader_a_shard(tmp_path: Path, world: int) -> None:
    """Beyond its own shard's header (shard r % 3) and shard 0's replicated tensor, each saved
    shard is opened by one restoring rank at most."""
    extra = [_shards(json.loads((tmp_path / f"restore-{world}-{r}.json").read_text())["opens"]) - {r % 3, 0}
             for r in range(world)]
    assert sum(len(e) for e in extra) == len(set().union(*extra)), extra


def test_a_damaged_shard_fails_the_restore_on_every_rank_with_the_readers_own_error(tmp_path: Path,
                                                                                    saved: Path) -> None:
    """4 ranks restore the 3-rank step; a flipped byte in row 8 of `w` in shard 2. Shard 2's reader
    is rank 3 (it takes 21 of its elements, rank 2 13), which reads row 8 for rank 2, finds the
    digest wrong and sends rank 2 a failed message. Every rank raises the same error, the reader's
    own (rank 2's report that its reader failed comes after it, though rank 2 is lower), none
    waits forever (the step asked for explicitly: no fallback), nothing is applied."""
    _copy(saved, tmp_path)
    path = next((tmp_path / "ck").glob("step_000000001/rank-00002-of-00003.safetensors"))
    raw = bytearray(path.read_bytes())
    header = int.from_bytes(raw[:8], "little")
    meta = json.loads(raw[8:8 + header])
    assert meta["w"]["shape"] == [4, 4]  # rows 8-11 of w
    raw[8 + header + meta["w"]["data_offsets"][0] + 5] ^= 0x40  # row 8
    path.write_bytes(bytes(raw))
    _run(4, "restore", tmp_path, SLURMRESUME_RESHARD_EXCHANGE="1")
    errors = [json.loads((tmp_path / f"restore-4-{r}.json").read_text()).get("error") for r in range(4)]
    assert errors[0] and len(set(errors)) == 1, errors
    assert "rank-00002-of-00003" in errors[0] and "checksum" in errors[0], errors[0]
    assert "could not read the saved pieces" not in errors[0], errors[0]


@pytest.mark.slow
def test_64_gloo_ranks_restore_exactly_with_and_without_the_exchange(tmp_path: Path, saved: Path) -> None:
    """64 real gloo ranks (EXCHANGE_MIN_RANKS) restore the 3-rank step. By default ("auto") they
    read their own boxes: they would open ~1 shard a rank, not worth a network hop. Forced, each
    saved shard is opened by one rank beyond the headers; every rank's tensors exact both ways."""
    _copy(saved, tmp_path)
    for forced in (False, True):
        log = _run(exchange.EXCHANGE_MIN_RANKS, "restore", tmp_path,
                   **({"SLURMRESUME_RESHARD_EXCHANGE": "1"} if forced else {}))
        assert ("each saved shard opened by one rank and sent" in log) is forced, log[-3000:]
        for rank in range(exchange.EXCHANGE_MIN_RANKS):
            got = json.loads((tmp_path / f"restore-64-{rank}.json").read_text())
            assert got["step"] == 1 and got["exact"], (forced, rank, got)
    _one_reader_a_shard(tmp_path, exchange.EXCHANGE_MIN_RANKS)

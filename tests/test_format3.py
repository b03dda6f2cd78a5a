"""Format 3: format 2 with the manifest's per-shard table as columns (checkpoint/shardtable.py), so
that a restoring rank's parse of the manifest makes no object per shard. The restore and tools
on format-3 roots are the rest of the suite (every save writes format 3); format-2 roots stay
readable (tests/test_golden_format2.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.core import save_steps, shard_rows, step_dir

from slurmresume.checkpoint.layout import MANIFEST
from slurmresume.checkpoint.manifest import read_manifest
from slurmresume.checkpoint.shardtable import ShardTable, columns, problem, rows

W = 3
D = "0123456789abcdef"


def _rows(world: int = W) -> list[dict]:
    return [{"file": f"rank-{r:05d}-of-{world:05d}.safetensors", "rank": r, "bytes": 100 + r, "xxh3": D,
             "header_xxh3": D[::-1], "index": f"rank-{r:05d}.index.json", "index_bytes": 50 + r,
             "index_xxh3": D.upper().lower()} for r in range(world)]


def test_a_saved_manifest_stores_the_shard_table_as_columns_with_names_from_the_rank(tmp_path: Path) -> None:
    save_steps(tmp_path, [1]).close()
    manifest = json.loads((step_dir(tmp_path, 1) / MANIFEST).read_text())
    assert manifest["format"] == "slurmresume/3"
    assert set(manifest["shards"]) == {"bytes", "xxh3", "header_xxh3", "index_bytes", "index_xxh3"}
    m = read_manifest(step_dir(tmp_path, 1), 1)
    assert isinstance(m.shards, ShardTable) and m.has_block_digests and m.shards.built == {}
    assert m.total_bytes == manifest["shards"]["bytes"][0] and m.shards.built == {}
    assert m.shards[0] == shard_rows(manifest)[0] and m.shards[0]["file"] == "rank-00000-of-00001.safetensors"


def test_rows_and_columns_round_trip_and_names_are_listed_only_when_not_derived() -> None:
    table = columns(_rows())
    assert "file" not in table and "index" not in table and problem(table, W) is None
    assert rows(table, W) == _rows() and columns(rows(table, W)) == table
    node = [{**r, "file": f"node-00000.bin@{4096 * i}", "index": f"node-00000.bin@{4096 * i + 200}"}
            for i, r in enumerate(_rows())]
    table = columns(node)
    assert table["file"] == [r["file"] for r in node] and problem(table, W) is None and rows(table, W) == node


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.update(bytes=t["bytes"][:2]), "expected 3 shards"),
    (lambda t: t["bytes"].__setitem__(1, 7), "rank-00001-of-00003.safetensors has an invalid size 7"),
    (lambda t: t["bytes"].__setitem__(2, True), "invalid size True"),
    (lambda t: t.update(bytes="100"), "invalid size column"),
    (lambda t: t.update(xxh3=t["xxh3"][:-1] + "g"), "no valid checksum"),
    (lambda t: t.update(header_xxh3=t["header_xxh3"][16:]), "no valid header checksum"),
    (lambda t: t.update(index_xxh3=None), "no valid index checksum"),
    (lambda t: t["index_bytes"].__setitem__(0, 0), "no valid index size"),
    (lambda t: t.update(file=["rank-00000-of-00003.safetensors"] * 3), "two shard entries name the same file"),
    (lambda t: t.update(file=["../x", "b", "c"]), "not a plain shard file name"),
    (lambda t: t.update(index=["rank-00000.index.json", "rank-00000.index.json", "rank-00002.index.json"]),
     "shard 1's index file is 'rank-00000.index.json'"),
    (lambda t: t.update(extra=[1, 2, 3]), "unknown columns ['extra']"),
])
def test_a_malformed_table_is_refused_with_one_line(edit: object, message: str) -> None:
    table = columns(_rows())
    edit(table)  # type: ignore[operator]
    assert message in (problem(table, W) or "")


def test_a_damaged_table_in_a_committed_step_is_refused_and_restore_falls_back(tmp_path: Path) -> None:
    from helpers.core import restore_fresh, rewrite_manifest

    save_steps(tmp_path, [1, 2]).close()
    rewrite_manifest(step_dir(tmp_path, 2), lambda m: m["shards"][0].update(xxh3="x" * 16))
    step, _ = restore_fresh(tmp_path)
    assert step == 1


class _Mesh:
    """A DeviceMesh's shape and this rank's coordinate (what the plan asks of one)."""

    def __init__(self, shape: tuple[int, ...], coord: tuple[int, ...]) -> None:
        self.shape, self._coord, self.ndim = shape, coord, len(shape)

    def get_coordinate(self) -> list[int]:
        return list(self._coord)


@pytest.mark.parametrize(("shape", "mesh", "placements"), [
    ((12, 4), (3,), ("shard:0",)), ((10, 7), (4,), ("shard:1",)), ((2, 5), (4,), ("shard:0",)),
    ((9, 6), (2, 3), ("shard:0", "shard:1")), ((13, 5), (2, 3), ("shard:0", "shard:0")),
])
def test_a_box_on_its_saved_layout_has_its_own_coordinate_as_its_one_holder(shape: tuple, mesh: tuple,
                                                                              placements: tuple) -> None:
    """The restore plan's shortcut (`plan_reads`) for a same-W restore (the live layout is the
    saved one) gives the holders `placement.holders` gives, for every coordinate (empty pieces
    hold nothing), and the boxes `boxes_of` gives."""
    import itertools

    from torch.distributed.tensor import Shard

    from slurmresume.checkpoint.boxes import Target, boxes_of, plan_reads
    from slurmresume.checkpoint.sharding import Sharded

    tensor = Sharded("w", "F32", shape, (), (mesh, placements))
    live = tuple(Shard(int(p[6:])) for p in placements)
    for coord in itertools.product(*(range(n) for n in mesh)):
        where = {"w": Target(_Mesh(mesh, coord), live, None)}
        (box_shape, offset), = boxes_of({"w": tensor}, where).values()
        expected = {p.rank for p in tensor.pieces_in(offset, box_shape)} if 0 not in box_shape else set()
        boxes, sources, _ = plan_reads({"w": tensor}, where)
        assert boxes == {"w": (box_shape, offset)} and sources == expected, coord

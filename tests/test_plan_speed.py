"""The restore plan's shortcuts (#29: a non-zero rank's plan at 70B/405B shapes) keep every check
they replace: an index entry that is not exactly its expected piece gets the full checks and
their error; the skeleton's DTensor placements are checked where the restore reads them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from slurmresume.checkpoint.rankindex import check_pieces
from slurmresume.errors import CorruptCheckpointError

W = 4
SPEC = {"dtype": "F32", "shape": [10, 3], "mesh_shape": [W], "placements": ["shard:0"], "mesh_arange": True}


def _entry(rank: int, **edit: Any) -> dict[str, Any]:
    rows = [3, 3, 3, 1][rank]  # torch's rule: ceil(10 / 4) = 3 rows a rank, the last gets 1
    return {"dtype": "F32", "shape": [rows, 3], "xxh3": ["0" * 16], "global_shape": [10, 3],
            "global_offset": [3 * rank, 0], **edit}


@pytest.mark.parametrize("placed", [True, False])
def test_exact_pieces_pass_on_every_rank(placed: bool) -> None:
    specs = {f"t{i}": SPEC for i in range(5)}  # five tensors of one shape: one box worked out
    for rank in range(W):
        check_pieces({f"t{i}": _entry(rank) for i in range(5)}, rank, W, specs, placed)


@pytest.mark.parametrize("edit, message", [
    ({"global_offset": [3.0, 0]}, "global offset"),  # equal to the right int, not an int
    ({"global_offset": [True, 0]}, "global offset"),
    ({"shape": [3.0, 3]}, "shape"),
    ({"global_shape": [10, 3.0]}, "global shape"),
    ({"global_offset": [6, 0]}, "disagrees with the placements"),
    ({"shape": [2, 3]}, "disagrees with the placements"),
    ({"dtype": "BF16"}, "disagree"),
    ({"global_shape": [11, 3]}, "disagree"),
])
def test_an_entry_that_is_not_exactly_its_piece_is_refused_with_the_full_checks_message(
        edit: dict[str, Any], message: str) -> None:
    entries = {"a": _entry(1), "b": _entry(1, **edit)}  # "a" makes the box known first
    with pytest.raises(CorruptCheckpointError, match=message):
        check_pieces(entries, 1, W, {"a": SPEC, "b": SPEC}, True)


class _FakeDTensor:
    """What boxes.targets asks of a live DTensor: its mesh, placements, shape."""

    def __init__(self) -> None:
        self.device_mesh, self.placements, self.shape = SimpleNamespace(ndim=1), (), (10, 3)

    def to_local(self) -> None:  # pragma: no cover - never called here
        return None


@pytest.mark.parametrize("placements", [["bogus"], ["shard:7"], [3]])
def test_the_skeletons_placements_are_checked_where_the_restore_reads_them(placements: list[Any]) -> None:
    """validate_skeleton(specs=False) leaves the skeleton's DTensor specs to their one reader: a
    tensor with no live DTensor and no parameter takes its saved placements on the live mesh."""
    from slurmresume.checkpoint.boxes import targets
    from slurmresume.checkpoint.sharding import Sharded

    index = {"opt/state/0/m": Sharded("opt/state/0/m", "F32", (10, 3), (), ((W,), ("shard:0",)))}
    with pytest.raises(CorruptCheckpointError, match="placements"):
        targets({}, {"w": _FakeDTensor()}, index, {"opt/state/0/m": {"placements": placements}})


def test_the_plan_checks_only_the_dtensor_section_s_type() -> None:
    from slurmresume.checkpoint.state import validate_skeleton

    skeleton = {"entries": {}, "dtensors": {"x": {"shape": "not a shape"}}}
    with pytest.raises(CorruptCheckpointError):
        validate_skeleton([], skeleton)  # every other reader: the whole section
    validate_skeleton([], skeleton, specs=False)  # the restore plan: its placements, where read
    with pytest.raises(CorruptCheckpointError, match="not an object"):
        validate_skeleton([], {"entries": {}, "dtensors": []}, specs=False)


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Metadata operations at the os seam (as scripts/bench_scale.py counts them): (kind, name).
    Only this thread's: the patch is process-wide, and a lease heartbeat that an earlier test
    left running in this worker makes its own ~14 (seen in CI: 21 counted for a pick of 7)."""
    import os
    import threading

    seen: list[tuple[str, str]] = []
    mine = threading.get_ident()
    for name in ("stat", "lstat", "open", "scandir", "listdir"):
        real = getattr(os, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            if threading.get_ident() == mine:
                seen.append((_name, os.path.basename(str(a[0])) if a else ""))
            return _real(*a, **k)
        monkeypatch.setattr(os, name, counted)
    return seen


def test_rank_0s_pick_of_a_committed_step_costs_7_metadata_operations(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """#29: rank 0's choice is the one part of a restore's operations that is not per rank (the
    reshard 16,384 -> 12,288 was 8 over 4 W with it). List the root, lstat the step, look up the
    marker and `.inprogress` (retention's question), read the marker, read the manifest, list the
    step for a killed writer's leftovers: 7. The old code took 9 (the step's lstat twice, the
    marker looked up twice)."""
    from helpers.core import save_steps, step_dir

    from slurmresume.train.messages import RestoreChoice
    from slurmresume.train.restorechoice import pick

    save_steps(tmp_path, [1, 2]).close()
    (step_dir(tmp_path, 2) / ".rank-00000-of-00001.safetensors.tmp.99").write_bytes(b"x")  # a killed writer's
    seen = _counting(monkeypatch)
    choice = pick(tmp_path, None, False, set(), False, None)
    monkeypatch.undo()
    assert isinstance(choice, RestoreChoice) and choice.step == 2
    assert len(seen) <= 7, seen
    assert not (step_dir(tmp_path, 2) / ".rank-00000-of-00001.safetensors.tmp.99").exists()  # still cleaned



def test_a_reader_without_a_restores_fds_opens_each_shard_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """shardread.open_read, the one place the readers choose between a restore's kept fds and their
    own open: `load_tensors`, `verify_tensors` and reshard.ShardFiles (the tools: compare,
    export, drill checks) read the header and the data through one fd. The old code opened
    each shard twice (the header's open, then the data's)."""
    from helpers.core import save_steps, step_dir

    from slurmresume.checkpoint.manifest import read_manifest
    from slurmresume.checkpoint.reshard import ShardFiles
    from slurmresume.checkpoint.shard import st_dtype
    from slurmresume.checkpoint.sharding import Sharded
    from slurmresume.checkpoint.shardread import load_tensors, verify_tensors

    save_steps(tmp_path, [1]).close()
    d = step_dir(tmp_path, 1)
    m = read_manifest(d, 1)
    s = m.shards[0]
    seen = _counting(monkeypatch)
    tensors, _, _ = load_tensors(d, s["file"], s["bytes"], expect=m.expected(0))
    assert tensors and [k for k, n in seen if k == "open" and n == s["file"]] == ["open"]
    seen.clear()
    assert verify_tensors(d, s["file"], s["bytes"], set(tensors), m.expected(0)) > 0
    assert [k for k, n in seen if k == "open" and n == s["file"]] == ["open"]
    seen.clear()
    name, t = next(iter(tensors.items()))
    files = ShardFiles(d, m.shards, m.expected)
    files.piece(0, Sharded(name, st_dtype(t), tuple(t.shape), ()), tuple(t.shape))
    files.close()
    assert [k for k, n in seen if k == "open" and n == s["file"]] == ["open"]


@pytest.mark.parametrize("edit", [
    lambda raw: raw.replace(b"{", b'{"world_size":1,', 1),  # a duplicate key: equal data to a plain parse
    lambda raw: raw.replace(b"{", b"{ ", 1),  # one byte of whitespace
    lambda raw: raw[:-1] + b',"step":NaN}',  # a NaN literal
])
def test_a_manifest_whose_bytes_differ_from_the_pinned_digest_is_refused_by_the_other_ranks(
        tmp_path: Path, edit: Any) -> None:
    """A non-zero rank parses the manifest with plain json.loads (manifest.read_pinned): only the
    bytes rank 0 parsed strictly and chose, pinned by their digest, get that far. Bytes that
    differ, even where a plain parse reads the same data (a duplicate key), are refused before
    any is parsed, and nothing of the step is read."""
    import json

    from helpers.core import save_steps, step_dir, tiny_state

    from slurmresume.checkpoint.layout import MANIFEST
    from slurmresume.checkpoint.state import flatten_live
    from slurmresume.train import messages, restorechoice, restoreplan

    save_steps(tmp_path, [1]).close()
    choice = restorechoice.pick(tmp_path, None, False, set(), False, None)
    assert isinstance(choice, messages.RestoreChoice)
    wire = messages.pick_from_json(json.loads(json.dumps(messages.pick_to_json(choice))))
    state = tiny_state(7)
    live = flatten_live(state)
    good = restoreplan.plan_part(0, wire, state, live, True)  # the pinned bytes: planned
    assert isinstance(good, restoreplan.Part)
    good.opened.close()
    path = step_dir(tmp_path, 1) / MANIFEST
    path.write_bytes(edit(path.read_bytes()))
    bad = restoreplan.plan_part(0, wire, state, live, True)
    assert isinstance(bad, messages.Failure) and "changed since rank 0 chose" in bad.message


def _shard_with(tmp_path: Path, entries: dict[str, Any], data: int) -> tuple[Path, str, int]:
    """A shard file of `data` zero bytes whose header is `entries` (a safetensors layout)."""
    import json
    import struct

    from slurmresume.checkpoint.layout import shard_name

    raw = json.dumps(entries).encode()
    name = shard_name(0, 1)
    (tmp_path / name).write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(data))
    return tmp_path, name, 8 + len(raw) + data


def _t(begin: Any, stop: Any, shape: Any = None, dtype: Any = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": [(stop - begin) // 4] if shape is None else shape, "data_offsets": [begin, stop]}


@pytest.mark.parametrize("entries, message", [
    ({"a": _t(0, 8), "b": _t(8.0, 16, [2])}, "malformed data_offsets"),  # equal to the right int, a float
    ({"a": _t(0, 8), "b": _t(8, 16, [True, 2])}, "bad dtype or shape"),  # True == 1: same size as [1, 2]
    ({"a": _t(0, 8, [1, 2]), "b": _t(8, 16, [True, 2])}, "bad dtype or shape"),  # ... after [1, 2] was sized
    ({"a": _t(0, 8, [2.0])}, "bad dtype or shape"),
    ({"a": _t(0, 8), "b": _t(8, 16, [-2, -1])}, "bad dtype or shape"),
    ({"a": _t(0, 8), "b": _t(8, 16, dtype="F33")}, "bad dtype or shape"),
    ({"a": _t(0, 8), "b": _t(8, 16, dtype=["F32"])}, "bad dtype or shape"),  # unhashable
    ({"a": _t(0, 8), "b": _t(12, 16)}, "offsets outside the file"),  # a gap
    ({"a": _t(0, 8), "b": _t(4, 12, [2])}, "offsets outside the file"),  # overlap
    ({"a": _t(0, 8), "b": _t(8, 16, [3])}, "offsets outside the file"),  # size disagrees with shape
    ({"a": _t(0, 8)}, "does not fill the file"),
    ({"a": _t(0, 8), "__metadata__": _t(8, 16)}, "does not fill the file"),  # metadata is no tensor
    ({"a": _t(0, 8), "b": "x"}, "malformed data_offsets"),
])
def test_a_header_the_in_order_pass_does_not_show_good_gets_read_headers_own_checks(
        tmp_path: Path, entries: dict[str, Any], message: str) -> None:
    """shardread.read_header checks the entries in the order written, in one pass with each
    distinct (dtype, shape) sized once (#29: 405B's 3,411 entries per plan); whatever that pass
    does not show good gets the sorted checks and their error, never a pass."""
    from slurmresume.checkpoint.shardread import read_header
    from slurmresume.errors import UnsafeCheckpointError

    with pytest.raises((CorruptCheckpointError, UnsafeCheckpointError), match=message):
        read_header(*_shard_with(tmp_path, entries, 16))


@pytest.mark.parametrize("entries", [
    {"a": _t(0, 8), "b": _t(8, 16)},
    {"b": _t(8, 16), "a": _t(0, 8)},  # out of order: the sorted checks accept it
    {"a": _t(0, 8), "e": _t(8, 8, [0]), "b": _t(8, 16)},
    {"__metadata__": {"format": "pt"}, "a": _t(0, 16, [2, 2])},
])
def test_a_good_header_is_accepted_in_any_order(tmp_path: Path, entries: dict[str, Any]) -> None:
    from slurmresume.checkpoint.shardread import read_header

    header, start = read_header(*_shard_with(tmp_path, entries, 16))
    assert header == entries and start == 8 + len(__import__("json").dumps(entries).encode())


def test_placement_kinds_worked_out_once_per_type_agree_with_asking_each_dtensor() -> None:
    """boxes.plan_reads asks each distinct sequence of placement types once (#29: torch's
    placements hash and compare in Python, ~2 ms of a 405B plan): a Shard subclass (FSDP2+TP's
    _StridedShard, refused by the kinds) or a Partial after a Shard of the same dim is not taken
    for it, and every answer is `placement_kinds`' own."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from slurmresume.checkpoint.boxes import _kinds_by_type, placement_kinds

    seqs = [(Shard(0),), (Shard(1),), (_StridedShard(0, split_factor=2),), (Shard(0),), (Replicate(),), (Partial(),),
            (Shard(0), Replicate()), (Replicate(), Shard(0)), (Shard(0), _StridedShard(0, split_factor=2)),
            (Shard(0), Shard(0)), (), (Shard(1),)]
    cache: dict[Any, Any] = {}
    for placements in seqs:
        assert _kinds_by_type(placements, cache, Shard) == placement_kinds(placements), placements
    assert _kinds_by_type((_StridedShard(0, split_factor=2),), cache, Shard) is None


@pytest.mark.parametrize("digests", [None, "0" * 16, ["0" * 15], ["0" * 17], [16 * "0", 7], [[16 * "0"]], [None]])
def test_an_index_entry_with_malformed_digests_is_refused_and_named(tmp_path: Path, digests: Any) -> None:
    """rankindex.read_index checks every entry's block digests at once (#29: 405B, 3,411 entries a
    plan); one malformed entry among good ones is still refused, by name."""
    import xxhash

    from slurmresume.checkpoint.layout import index_name, shard_name
    from slurmresume.checkpoint.rankindex import index_bytes, read_index

    good = {"dtype": "F32", "shape": [3], "xxh3": ["0123456789abcdef"]}
    tensors = {"a": good, "b": {**good, "xxh3": digests}, "c": good}
    if digests is None:
        del tensors["b"]["xxh3"]
    raw = index_bytes(1, shard_name(1, 4), tensors)
    (tmp_path / index_name(1)).write_bytes(raw)
    shard = {"rank": 1, "file": shard_name(1, 4), "index": index_name(1), "index_bytes": len(raw),
             "index_xxh3": xxhash.xxh3_64_hexdigest(raw)}
    with pytest.raises(CorruptCheckpointError, match="tensor 'b' has a malformed entry"):
        read_index(tmp_path, shard)
    del tensors["b"]
    raw = index_bytes(1, shard_name(1, 4), tensors)
    (tmp_path / index_name(1)).write_bytes(raw)
    assert read_index(tmp_path, {**shard, "index_bytes": len(raw), "index_xxh3": xxhash.xxh3_64_hexdigest(raw)}) == tensors

"""Issue 49 on several nodes, the pure parts: which step every node holds, and a node's copy of a
snapshot finished (train/memtier.py, train/memrestore.py). The end-to-end run on two emulated
nodes is tests/test_unwarned_nodes.py::test_a_rank_killed_on_one_node_restarts_from_each_nodes_memory_and_ends_bitwise
(it shares that module's uninterrupted reference run)."""

from __future__ import annotations

from pathlib import Path

from slurmresume.checkpoint.layout import MARKER, step_dir_name
from slurmresume.train.memrestore import common_step
from slurmresume.train.memtier import finish_node


def test_common_step_is_the_newest_every_node_holds_with_rank_0s_marker() -> None:
    assert common_step([[[7, "a"], [6, "b"]], [[7, "a"], [6, "b"]]]) == 7
    assert common_step([[[7, "a"], [6, "b"]], [[6, "b"]]]) == 6  # a node whose copy of 7 did not finish
    assert common_step([[[7, "a"]], [[7, "OTHER"]]]) is None  # another trajectory's 7: never mixed
    assert common_step([[[7, "a"]], []]) is None
    assert common_step([]) is None


def test_finish_node_publishes_the_nodes_copy_marker_last_and_refuses_what_is_not_its_save(tmp_path: Path) -> None:
    into = f".saving.{step_dir_name(5)}.0123456789abcdef"
    (tmp_path / into).mkdir()
    (tmp_path / into / "rank-00002-of-00004.safetensors").write_bytes(b"x")
    manifest, marker = b'{"m": 1}', b'{"step": 5}'
    packed = len(manifest).to_bytes(8, "big") + manifest + marker
    assert finish_node(tmp_path, 6, into, packed) is not None  # not this step's save directory
    assert finish_node(tmp_path, 5, into, packed[:10]) is not None  # cut on the way
    assert finish_node(tmp_path, 5, into, packed) is None
    step = tmp_path / step_dir_name(5)
    assert (step / MARKER).read_bytes() == marker and (step / "manifest.json").read_bytes() == manifest
    assert not (tmp_path / into).exists()
    assert finish_node(tmp_path, 5, into, packed) is not None  # nothing left of it to publish again

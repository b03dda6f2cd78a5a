"""Issue 49 on several nodes, the pure parts: which step every node holds, and a node's copy of a
snapshot finished (train/memtier.py, train/memrestore.py). The end-to-end run on two emulated
nodes is tests/test_unwarned_nodes.py::test_a_rank_killed_on_one_node_restarts_from_each_nodes_memory_and_ends_bitwise
(it shares that module's uninterrupted reference run)."""

from __future__ import annotations

from pathlib import Path

from slurmresume.checkpoint.layout import MARKER, step_dir_name
from slurmresume.train.memrestore import common_step
from slurmresume.train.memtier import finish_node


def test_common_step_is_the_newest_every_node_holds_with_rank_0s_marker_and_each_ranks_shard() -> None:
    both = [[7, "a", True], [6, "b", True]]
    assert common_step([both, both]) == 7
    assert common_step([both, [[6, "b", True]]]) == 6  # a node whose copy of 7 did not finish
    assert common_step([[[7, "a", True]], [[7, "OTHER", True]]]) is None  # another trajectory's 7: never mixed
    assert common_step([[[7, "a", True]], []]) is None
    assert common_step([]) is None
    # the rendezvous moved rank 1 to the other node: its node holds step 7, but not rank 1's shard
    assert common_step([both, [[7, "a", False], [6, "b", False]]]) is None


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


# -- a node lost whole: the survivors' memory and its replica committed to the root (job/promote.py) --


def test_choose_takes_the_newest_step_held_whole_with_one_marker() -> None:
    from slurmresume.job.promote import choose

    held = {0: {"own": {"7": "a", "6": "b"}, "replicas": {"2": {"7": "a", "6": "b"}}},
            1: {"own": {"7": "a", "6": "b"}, "replicas": {"2": {}}}}
    assert choose(held, [0, 1], {2}) == (7, "a")
    assert choose({**held, 1: {"own": {"6": "b"}, "replicas": {}}}, [0, 1], {2}) == (6, "b")  # 7 not on node 1
    assert choose({**held, 0: {"own": {"7": "a"}, "replicas": {"2": {"7": "X"}}}}, [0, 1], {2}) is None  # another 7
    assert choose({0: held[0]}, [0, 1], {2}) is None  # node 1 said nothing


def _node_roots(tmp_path: Path, step: int, world: int, lost: int, holder: int) -> tuple[Path, list[Path]]:
    """A step of `world` ranks as the memory tier leaves it on `world` nodes of one rank each: each
    node's root holds its rank's files with the manifest and marker; `holder` also holds the replica
    of node `lost` (job/peercopy.py). Returns the whole step (the reference) and the roots."""
    import shutil

    from helpers.core import save_as_world

    from slurmresume.checkpoint.manifest import read_manifest
    from slurmresume.job.peercopy import replica_root

    whole = save_as_world(tmp_path / "whole", step, world)
    files = read_manifest(whole).files
    mems = []
    for n in range(world):
        mem = tmp_path / f"mem{n}"
        parts = [mem / step_dir_name(step)] + ([replica_root(mem, lost) / step_dir_name(step)] if n == holder else [])
        for d, rank in zip(parts, [n, lost]):
            d.mkdir(parents=True)
            for name in ("manifest.json", MARKER):
                shutil.copyfile(whole / name, d / name)
            for f in files:
                if f["rank"] == rank:
                    shutil.copyfile(whole / f["file"], d / f["file"])
        mems.append(mem)
    return whole, mems


def _promote_all(tmp_path: Path, root: Path, mems: list[Path], lost: int) -> dict[int, dict]:
    import threading

    from slurmresume.job.promote import promote

    shared = tmp_path / "shared"
    shared.mkdir(exist_ok=True)
    out: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda n=n: out.__setitem__(n, promote(root, shared, mems[n], n, len(mems),
                                                                               {lost}, wait=30)))
               for n in range(len(mems)) if n != lost]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_a_lost_nodes_replica_and_the_survivors_memory_commit_one_step_byte_for_byte(tmp_path: Path) -> None:
    from slurmresume.checkpoint.store import inspect_dir

    whole, mems = _node_roots(tmp_path, 7, 3, lost=2, holder=0)
    root = tmp_path / "root"
    out = _promote_all(tmp_path, root, mems, lost=2)
    assert out[0]["committed"] is True and out[0]["step"] == 7, out
    got = root / step_dir_name(7)
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in whole.iterdir())
    assert all((got / p.name).read_bytes() == p.read_bytes() for p in whole.iterdir())
    assert inspect_dir(7, got, verify=True).problem is None
    assert not list(root.glob(".saving.*"))


def test_a_flipped_byte_in_the_replica_or_a_newer_committed_step_commits_nothing(tmp_path: Path) -> None:
    from helpers.core import save_as_world

    from slurmresume.job.peercopy import replica_root

    _whole, mems = _node_roots(tmp_path, 7, 3, lost=2, holder=0)
    shard = next((replica_root(mems[0], 2) / step_dir_name(7)).glob("rank-*.safetensors"))
    raw = bytearray(shard.read_bytes())
    raw[-2] ^= 0x04
    shard.write_bytes(bytes(raw))
    root = tmp_path / "root"
    out = _promote_all(tmp_path, root, mems, lost=2)
    assert out[0]["committed"] is False and "does not match its manifest" in out[0]["why"], out
    assert not (root / step_dir_name(7)).exists() and not list(root.glob(".saving.*"))
    # a committed step at least as new (the ranks' own failure save): nothing is copied
    (tmp_path / "shared" / "promote").rename(tmp_path / "old-promote")
    save_as_world(root, 9, 3)
    out = _promote_all(tmp_path, root, mems, lost=2)
    assert out[0]["committed"] is False and "step 9 is committed already" in out[0]["why"], out
    assert out[1]["committed"] is False
    assert not (root / step_dir_name(7)).exists()


# -- which snapshots a node keeps for the peer copy (peerpin.py) --------------------------------


def test_the_target_becomes_keep_only_once_every_nodes_replica_of_it_is_acked() -> None:
    from slurmresume.peerpin import Pins, advance

    # nothing pinned yet: the snapshot being written is the target
    assert advance(Pins(), None, False, False, 1) == Pins(1, None)
    # still being copied (the least ack is older): both kept as they are, whatever the snapshot
    assert advance(Pins(4, 2), 2, False, False, 6) == Pins(4, 2)
    assert advance(Pins(4, 2), None, False, False, 6) == Pins(4, 2)
    # every node's successor verified it: it is kept for a promotion, and this snapshot is next
    assert advance(Pins(4, 2), 4, False, False, 6) == Pins(6, 4)
    # a target some node lost, or whose copy was refused: dropped, never waited for; keep stays
    assert advance(Pins(4, 2), 4, True, False, 6) == Pins(6, 2)
    assert advance(Pins(4, 2), 2, False, True, 6) == Pins(6, 2)
    # a keep some node no longer holds is no keep
    assert advance(Pins(4, 2), 2, False, False, 6, keep_lost=True) == Pins(4, None)
    assert Pins(6, 4).held() == {4, 6} and Pins().held() == set()


def test_prune_keeps_the_pinned_steps_and_frees_the_rest(tmp_path: Path) -> None:
    from helpers.core import save_steps

    from slurmresume.checkpoint.layout import step_dirs
    from slurmresume.train.memtier import prune

    save_steps(tmp_path, [1, 2, 3, 4, 5])
    (tmp_path / f".saving.{step_dir_name(3)}.{'ab' * 8}").mkdir()  # a killed writer's leftover: never pinned
    prune(tmp_path, 5, {2, 4})
    assert sorted(s for s, _ in step_dirs(tmp_path)) == [2, 4, 5]
    assert not list(tmp_path.glob(".saving.*"))

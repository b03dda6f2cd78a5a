"""The per-node layout (#29 item 6, `checkpoint/nodefile.py`): 4 real gloo ranks as 2 emulated
nodes of 2 (LOCAL_WORLD_SIZE=2) write one `node-NNNNN.bin` per node, each rank its own range.
The ranks are forked from one process that imported torch (helpers/forkranks.py), not started
by torchrun: what is tested is the layout, and each torchrun rank's own torch import cost more
than its save."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.core import shard_rows
from helpers.procs import HELPERS, clean_env, run_ranks
from typer.testing import CliRunner

from slurmresume.checkpoint.layout import MANIFEST, MARKER
from slurmresume.checkpoint.nodefile import node_ranks, ranges
from slurmresume.cli import app

SCRIPT = HELPERS / "node_layout.py"


def _ranks(world: int, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_ranks(world, SCRIPT, *args, env=clean_env(**env))


def _save(root: Path, steps: str, **env: str) -> subprocess.CompletedProcess[str]:
    return _ranks(4, "save", str(root), steps, SLURMRESUME_LAYOUT="per-node", NODE_SIZE="2", **env)


def _restore(root: Path, world: int, out: Path, **env: str) -> list[dict]:
    out.mkdir()
    res = _ranks(world, "restore", str(root), str(out), **env)
    assert res.returncode == 0, res.stderr[-4000:]
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pernode") / "ck"
    res = _save(root, "1,2")
    assert res.returncode == 0, res.stderr[-4000:]
    return root


def _manifest(step_dir: Path) -> dict:
    """manifest.json with its shard table as rows (format 3 stores columns)."""
    data = json.loads((step_dir / MANIFEST).read_text())
    return {**data, "shards": shard_rows(data)}


def test_a_per_node_step_holds_one_data_file_per_node_and_restores_bitwise(saved: Path, tmp_path: Path) -> None:
    d = saved / "step_000000002"
    assert sorted(p.name for p in d.iterdir()) == [MARKER, MANIFEST, "node-00000.bin", "node-00002.bin"]
    shards = _manifest(d)["shards"]
    assert [s["file"].partition("@")[0] for s in shards] == ["node-00000.bin"] * 2 + ["node-00002.bin"] * 2
    for a, b in ((shards[0], shards[1]), (shards[2], shards[3])):  # disjoint, aligned ranges in rank order
        start_a, start_b = int(a["file"].partition("@")[2]), int(b["file"].partition("@")[2])
        index_a = int(a["index"].partition("@")[2])  # the index right after the shard, in the rank's range
        assert start_a == 0 and start_b % 4096 == 0 and index_a == a["bytes"] <= index_a + a["index_bytes"] <= start_b
        assert (d / b["file"].partition("@")[0]).stat().st_size >= int(b["index"].partition("@")[2]) + b["index_bytes"]
    for r in _restore(saved, 4, tmp_path / "out"):
        assert r == {"step": 2, "value": 2, "emb": [2], "bias": [2]}, r


@pytest.mark.parametrize("exchange", ["0", "1"])
def test_a_per_node_step_reshards_4_to_3(saved: Path, tmp_path: Path, exchange: str) -> None:
    """Each rank reading its boxes, and (checkpoint/exchange.py) each saved rank's range read by its
    owner alone and sent."""
    out = tmp_path / "out"
    out.mkdir()
    res = _ranks(3, "restore", str(saved), str(out), SLURMRESUME_RESHARD_EXCHANGE=exchange)
    assert res.returncode == 0, res.stderr[-4000:]
    assert ("each saved shard opened by one rank and sent" in res.stderr) is (exchange == "1"), res.stderr[-4000:]
    for r in [json.loads((out / f"{r}.json").read_text()) for r in range(3)]:
        assert r == {"step": 2, "value": 2, "emb": [2], "bias": [2]}, r


def test_checkpointer_after_checkpointer_in_one_process_saves_per_node_and_restores(tmp_path: Path) -> None:
    """3 ranks as one node of 3, one process each: a Checkpointer saves steps 1 and 2, closes; four
    more, one after another, save steps 3..6 (beside the one of step 3 a second Checkpointer is
    open, saving asynchronously to another root); another restores step 6 bit for bit. The old code
    made a new node subgroup for each Checkpointer, which torch named as the last one (a hash of
    the ranks and the number of live groups), so its gloo rendezvous read the destroyed group's
    addresses from the store: "Connection refused" on some ranks, the others waiting in the group's
    creation or the next collective until the job's time ran out (within the first three
    Checkpointers in each of 4 runs)."""
    root, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    res = run_ranks(3, SCRIPT, "cycle", str(root), str(out), env=clean_env(SLURMRESUME_LAYOUT="per-node", NODE_SIZE="3"),
                    timeout=60)
    assert res.returncode == 0, res.stderr[-4000:]
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [f"step_{s:09d}" for s in
                                                                                     range(1, 7)]
    for step in range(1, 7):
        assert sorted(p.name for p in (root / f"step_{step:09d}").iterdir()) == [MARKER, MANIFEST, "node-00000.bin"]
    for r in range(3):
        assert json.loads((out / f"{r}.json").read_text()) == {"step": 6, "value": 6, "emb": [6], "bias": [6]}
    twin = tmp_path / "ck-twin" / "step_000000003"
    assert sorted(p.name for p in twin.iterdir()) == [MARKER, MANIFEST, "node-00000.bin"]


_NODE_GROUPS_SCRIPT = """
import torch, torch.distributed as dist
from slurmresume.checkpoint.collective import NODE_GROUPS, NodeGroups, _ranks_of

def works(pg):
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)
    return t.item() == 2

def alive(pg):
    return pg in dist.distributed_c10d._world.pg_map

dist.init_process_group("gloo")
a = NODE_GROUPS.take([0, 1])
b = NODE_GROUPS.take([0, 1])  # a is in use: a second group
assert a is not b and works(a) and works(b)
NODE_GROUPS.give_back(a)
assert NODE_GROUPS.take([0, 1]) is a and works(a)  # handed on, not made again
other, rank = NodeGroups(), dist.get_rank()
c = other.take([0, 1])  # made while a and b live (made after they were destroyed, torch would
other.give_back(c)      # name it as one of them: the bug NodeGroups avoids)
NODE_GROUPS.give_back(b)
NODE_GROUPS.drain()  # at exit: the idle ones destroyed, any given back later too
assert NODE_GROUPS.idle == {} and not alive(b) and alive(a)
NODE_GROUPS.give_back(a)
assert NODE_GROUPS.idle == {} and not alive(a)
dist.destroy_process_group()  # c goes with it: no longer a group that could be handed out
assert _ranks_of(c) is None
other.give_back(c)
other.drain()
print(f"ok-{rank}", flush=True)
"""


def test_node_groups_are_handed_on_and_destroyed_at_exit(tmp_path: Path) -> None:
    """`collective.NodeGroups` on 2 real gloo ranks: a group given back is the next one taken (and
    still works); one in use is never handed out twice; at exit the idle ones are destroyed and
    any given back later; one gone with its default group is never handed out."""
    script = tmp_path / "node_groups.py"
    script.write_text(_NODE_GROUPS_SCRIPT)
    res = run_ranks(2, script, timeout=60)
    assert res.returncode == 0 and "ok-0" in res.stdout and "ok-1" in res.stdout, res.stderr[-3000:]


def test_verify_inspect_and_export_read_each_ranks_range(saved: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sys.path.insert(0, str(HELPERS))
    from node_layout import emb

    res = CliRunner().invoke(app, ["verify", "--ckpt-dir", str(saved), "--all"], terminal_width=200)
    assert res.exit_code == 0 and res.output.count("ok") == 2, res.output
    res = CliRunner().invoke(app, ["inspect", str(saved / "step_000000002")], terminal_width=200)
    rows = [ln.split() for ln in res.output.splitlines()]
    assert res.exit_code == 0 and [r[1] for r in rows if r[:1] == ["emb"] and r[1].isdigit()] == ["0", "1", "2", "3"]
    out = tmp_path / "emb.safetensors"
    res = CliRunner().invoke(app, ["export", "latest", "--only", "emb", "--out", str(out), "--ckpt-dir", str(saved)])
    assert res.exit_code == 0, res.output
    (tensor,) = load_file(out).values()
    assert tensor.equal(emb(2))


def test_a_flipped_byte_inside_one_ranks_range_fails_verify_and_the_restore_falls_back(saved: Path,
                                                                                       tmp_path: Path) -> None:
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    shard = _manifest(root / "step_000000002")["shards"][3]
    name, _, base = shard["file"].partition("@")
    path = root / "step_000000002" / name
    raw = bytearray(path.read_bytes())
    raw[int(base) + shard["bytes"] - 1] ^= 0x01  # the last data byte of rank 3, in the node's second range
    path.write_bytes(bytes(raw))
    res = CliRunner().invoke(app, ["verify", "--ckpt-dir", str(root), "--all"], terminal_width=200)
    assert res.exit_code != 0 and "step 2" in res.output, res.output
    for r in _restore(root, 4, tmp_path / "out"):
        assert r == {"step": 1, "value": 1, "emb": [1], "bias": [1]}, r


def test_a_rank_killed_mid_write_leaves_no_marker(saved: Path, tmp_path: Path) -> None:
    """Rank 3 dies (SIGKILL) on its second write into node-00002.bin (a 40 MiB shard: O_DIRECT
    writes it in 32 MiB pieces, the buffered paths in 32 MiB views): the save of step 3 never
    commits, the node file is left in the private save directory, and step 2 stays the newest."""
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    res = _save(root, "3", KILL_RANK="3", KILL_AT="write.shard.data:2", BIG_MIB="40", SLURMRESUME_WRITER="direct")
    assert res.returncode != 0
    assert not (root / "step_000000003").exists()
    (leftover,) = [p for p in root.iterdir() if p.name.startswith(".saving.step_000000003.")]
    assert (leftover / "node-00002.bin").exists() and not (leftover / MARKER).exists()
    from slurmresume.checkpoint.store import find_latest

    info = find_latest(root)
    assert info is not None and info.step == 2


@pytest.mark.parametrize(("rank", "label"), [("3", "write.shard.data"), ("2", "fsync.shard")])
def test_one_ranks_io_error_fails_the_save_on_every_rank_without_a_hang(saved: Path, tmp_path: Path, rank: str,
                                                                        label: str) -> None:
    """An I/O error on one rank of a node (rank 3 writing its range; rank 2, the node's first, at
    the node file's one fsync) still takes that rank through both node barriers: every rank gets
    the failed save in one line (no rank waits forever), nothing of step 3 is left, step 2 stays."""
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    res = _save(root, "3", FAIL_RANK=rank, FAIL_AT=label)
    assert res.returncode != 0
    failed = [line for line in res.stderr.splitlines() if "SaveError: checkpoint save failed, nothing committed" in line]
    assert len(failed) == 4 and all("injected I/O error" in line for line in failed), res.stderr[-3000:]
    assert sorted(p.name for p in root.iterdir() if "000000003" in p.name) == []
    from slurmresume.checkpoint.store import find_latest

    info = find_latest(root)
    assert info is not None and info.step == 2


@pytest.mark.parametrize(("rank", "world", "local_rank", "local", "expected"), [
    (5, 16, 5, 8, range(0, 8)), (8, 16, 0, 8, range(8, 16)), (3, 4, 1, 2, range(2, 4)),
    (3, 6, 1, 4, range(2, 6)),  # nodes of 2 and 4 ranks (torchrun: contiguous blocks per node)
    (0, 1, 0, 1, range(0, 1)), (2, 4, 0, 0, range(2, 3)), (2, 4, 3, 2, range(2, 3)), (3, 4, 0, 4, range(3, 4)),
])
def test_a_nodes_ranks(rank: int, world: int, local_rank: int, local: int, expected: range) -> None:
    assert node_ranks(rank, world, local_rank, local) == expected


def test_ranges_are_aligned_and_disjoint() -> None:
    assert ranges([10, 4096, 4097, 1]) == ([0, 4096, 8192, 16384], 20480)
    assert ranges([]) == ([], 0)


def test_creates_and_fsyncs_per_save_fewer_per_node_than_per_rank(tmp_path: Path) -> None:
    """scripts/bench_scale.py counts the save's metadata operations at the fsio/os seam: 16 ranks,
    per-rank against per-node with 8 ranks per node (2 node files). Per rank: a shard and an index
    (create + fsync each); per node: one node file (every rank's shard and index) created and
    fsynced once by its first rank."""
    out = tmp_path / "rows.json"
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_scale.py"
    res = subprocess.run([sys.executable, str(script), "--models", "tiny", "--ranks", "16", "--reshard", "",
                          "--no-memory", "--layout", "per-rank,per-node:8", "--dir", str(tmp_path),
                          "--json-out", str(out)], capture_output=True, text=True, timeout=300,
                         env=clean_env(PYTHONPATH=str(script.parents[1])))
    assert res.returncode == 0, res.stdout + res.stderr
    rank, node = json.loads(out.read_text())["rows"]
    assert rank["saved"] and node["saved"] and node["layout"] == "per-node/8"
    assert "error" not in node["same"], node["same"]  # the per-node step's restore plan (rank 0's pick too)
    creates = rank["save_ops"]["create"] - node["save_ops"]["create"]
    fsyncs = rank["save_ops"]["fsync"] - node["save_ops"]["fsync"]
    # 2 W files (shard, index) -> W / 8 node files
    assert creates == fsyncs == 2 * 16 - 2, (rank["save_ops"], node["save_ops"])
    assert node["save_ops"].get("rename", 0) < rank["save_ops"].get("rename", 0)


def test_the_mirror_refuses_a_per_node_step_in_one_line_before_touching_the_bucket(saved: Path) -> None:
    """This version's mirror copies a step file by file; a per-node step's ranges are not copied:
    the upload says so in one line, and no request reaches the bucket (nothing half-written)."""
    from slurmresume.errors import CheckpointError
    from slurmresume.mirror.transfer import upload_step
    from slurmresume.storage.s3 import S3Location

    class NoBucket:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the bucket was asked for {name}")

    with pytest.raises(CheckpointError, match="per-node layout") as err:
        upload_step(NoBucket(), S3Location("bucket"), saved / "step_000000002", 2)
    assert "\n" not in str(err.value) and "SLURMRESUME_LAYOUT=per-rank" in str(err.value)


@pytest.mark.parametrize("strategy", ["direct", "direct-par", "buffered-wb", "buffered", "buffered-par"])
def test_every_write_path_writes_only_its_range_of_a_shared_file(tmp_path: Path, strategy: str) -> None:
    """A node file's ranges written by each write path (O_DIRECT pads its last block to 4 KiB:
    inside the aligned range, never past it): the bytes around a range stay as they were, no
    truncate, no fsync by the writer (the node's first rank does it)."""
    import os

    import xxhash

    from slurmresume.checkpoint import fsio
    from slurmresume.checkpoint.writer import ShardSink

    path = tmp_path / "node-00000.bin"
    sizes = [5000, 70 << 20, 1]  # the middle one spans several staging buffers
    offsets, total = ranges(sizes)
    path.write_bytes(b"\xee" * total)
    payloads = [os.urandom(n) for n in sizes]
    synced: list[str] = []
    real = fsio.fsync_fd

    def record(fd: int, label: str, p: str = "", **kw: bool) -> None:  # a shard's fsync is recorded, not run;
        if label != "shard":  # another thread's (a lease heartbeat left by an earlier test) runs as it would
            return real(fd, label, p, **kw)
        synced.append(label)

    fsio.fsync_fd = record  # type: ignore[assignment]
    try:
        for base, data in zip(offsets, payloads):
            sink = ShardSink(path, strategy, base=base, shared=True, sync=False)
            sink.feed(memoryview(data))
            assert sink.finish() == xxhash.xxh3_64_hexdigest(data)
    finally:
        fsio.fsync_fd = real  # type: ignore[assignment]
    raw = path.read_bytes()
    assert len(raw) == total and synced == []
    for base, data in zip(offsets, payloads):
        assert raw[base : base + len(data)] == data


def test_a_checkpointer_refuses_a_bad_layout_or_a_mirrored_per_node_one_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmresume import Checkpointer
    from slurmresume.errors import ConfigError

    monkeypatch.setenv("SLURMRESUME_LAYOUT", "per-host")
    with pytest.raises(ConfigError, match="not a layout; valid: per-rank, per-node"):
        Checkpointer(tmp_path / "a", handle_signals=False)
    monkeypatch.setenv("SLURMRESUME_LAYOUT", "per-node")
    with pytest.raises(ConfigError, match="cannot be mirrored"):
        Checkpointer(tmp_path / "b", handle_signals=False, mirror="s3://bucket/prefix")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # refused before anything is written
    Checkpointer(tmp_path / "c", handle_signals=False).close()


def test_a_range_is_opened_only_inside_a_plain_node_file(tmp_path: Path) -> None:
    """A manifest's range names only our node files (no path, digits only) and must end inside
    the file; a node file replaced by a link is refused like a shard."""
    import os

    from slurmresume.checkpoint.shardread import hash_file, open_checked
    from slurmresume.errors import CorruptCheckpointError, UnsafeCheckpointError

    (tmp_path / "node-00000.bin").write_bytes(bytes(range(256)) * 32)  # 8 KiB
    assert hash_file(tmp_path, "node-00000.bin@4096", 4096) == hash_file(tmp_path, "node-00000.bin@4096", 4096)
    os.close(open_checked(tmp_path, "node-00000.bin@4096", 4096))
    with pytest.raises(CorruptCheckpointError, match="from byte 4097: truncated"):
        open_checked(tmp_path, "node-00000.bin@4097", 4096)
    for bad in ("node-00000.bin@", "node-00000.bin@-1", "node-00000.bin@01", "../node-00000.bin@0",
                "node-00000.bin@0@0", "other.bin@0"):
        with pytest.raises(UnsafeCheckpointError, match="not a plain shard file name"):
            open_checked(tmp_path, bad, 1)
    os.symlink(tmp_path / "node-00000.bin", tmp_path / "node-00008.bin")
    with pytest.raises(UnsafeCheckpointError):
        open_checked(tmp_path, "node-00008.bin@0", 1)


def test_a_restore_opens_a_node_file_once_for_all_the_ranges_it_reads(saved: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A resharding rank reads the ranges of several saved ranks, often of one node file: it is
    opened once (one metadata operation), each range's header read and checked through that fd,
    and closed once. The old code opened it once per range."""
    import os

    from slurmresume.checkpoint.manifest import read_manifest
    from slurmresume.checkpoint.opened import OpenShards

    d = saved / "step_000000002"
    m = read_manifest(d)
    opened: list[str] = []
    real = os.open

    def recording(p: str, *a: object, **k: object) -> int:
        if os.path.dirname(os.fspath(p)) == str(d):  # not a lease heartbeat an earlier test left running
            opened.append(os.path.basename(p))
        return real(p, *a, **k)  # type: ignore[arg-type]
    monkeypatch.setattr(os, "open", recording)
    files = OpenShards(d)
    got = [files.get(m.shards[r]["file"], m.shards[r]["bytes"], m.expected(r)) for r in (0, 1)]
    assert opened == ["node-00000.bin"] and got[0][0] == got[1][0] and got[0][2] < got[1][2]
    assert {n for g in got for n in g[1]} - {"__metadata__"}  # both ranges' headers, checked
    files.close()
    with pytest.raises(OSError):
        os.fstat(got[0][0])

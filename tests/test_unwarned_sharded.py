"""Issue 47, sharded states: a failure-time save covers a dead rank's pieces only from a survivor that
holds the same bytes (issue 49: or from the dead rank's verified memory snapshot of the same step,
tests/test_memshard.py). FSDP2 (every piece on one rank only): refused, naming the dead rank's pieces,
and the job resumes from the newest periodic step; HSDP 2x2 (each piece on two ranks, one per
replica): committed from the dead rank's replica peer, at most one step repeated. Both end bitwise
equal to an uninterrupted run (tests/helpers/sharded_train.py under `submit --local`)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.procs import HELPERS, clean_env, finish, rank_pid, signal_tree

from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.contract import ENV_DRILL_RECORD
from slurmresume.events import read_events
from slurmresume.tools.compare import compare_checkpoints
from slurmresume.train.steprecord import read_records
from slurmresume.train.survivors import Plan, Snapshot, Status, peers_of, plan, replica_dims

# -- the plan: which survivor holds a dead rank's pieces (tables, no processes) ---------------------

PIECES = ("model/0.weight", "optimizer/state/0/exp_avg")
HSDP = {n: ((2, 2), (True, False)) for n in PIECES}  # mesh (replicate=2, shard=2): ranks r and r^2 agree
FSDP = {n: ((4,), (False,)) for n in PIECES}  # one shard dim: no replica


def _big(world: int, *steps: int) -> dict[int, list[Snapshot]]:
    """Every rank published `steps`, its pieces too large to publish (named missing)."""
    return {r: [Snapshot(r, s, PIECES) for s in steps] for r in range(world)}


def _clean(*ranks: int, step: int = 7) -> dict[int, Status]:
    return {r: Status(r, step, True) for r in ranks}


def test_replica_dims_and_peers_follow_the_placements() -> None:
    specs = {"a": {"mesh_shape": [2, 2], "placements": ["replicate", "shard:0"], "mesh_arange": True},
             "b": {"mesh_shape": [4], "placements": ["shard:0"], "mesh_arange": True},
             "c": {"mesh_shape": [2, 2], "placements": ["shard:0", "shard:1"], "mesh_arange": False},
             "d": {"mesh_shape": [2], "placements": ["replicate"], "mesh_arange": True}}  # 2 ranks of 4
    dims = replica_dims(specs, 4)
    assert dims == {"a": ((2, 2), (True, False)), "b": ((4,), (False,))}
    assert [sorted(peers_of(r, dims["a"])) for r in range(4)] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [sorted(peers_of(r, dims["b"])) for r in range(4)] == [[0], [1], [2], [3]]


@pytest.mark.parametrize(("dead", "statuses", "replicas", "expect"), [
    # HSDP: rank 1 dead, its pieces are rank 3's; every survivor writes its own shard, rank 3 also rank 1's
    ({1}, _clean(0, 2, 3), HSDP, Plan(7, 0, shards=((1, 3), (2, 2), (3, 3)))),
    # rank 0 dead: rank 2 holds its pieces; rank 1, the lowest clean survivor, commits
    ({0}, _clean(1, 2, 3), HSDP, Plan(7, 1, shards=((0, 2), (2, 2), (3, 3)))),
    # rank 2 dead: its pieces are rank 0's, the committer's own
    ({2}, _clean(0, 1, 3), HSDP, Plan(7, 0, shards=((1, 1), (3, 3)))),
])
def test_plan_takes_a_dead_ranks_pieces_from_its_replica_peer(dead: set[int], statuses: dict[int, Status],
                                                              replicas: dict, expect: Plan) -> None:
    assert plan(4, dead, statuses, _big(4, 6, 7), replicas=replicas) == expect


@pytest.mark.parametrize(("dead", "statuses", "replicas", "says"), [
    # FSDP2: nobody else holds rank 1's pieces
    ({1}, _clean(0, 2, 3), FSDP, "step 7: rank 1's per-rank tensors model/0.weight, optimizer/state/0/exp_avg "
                                 "(not replicated, too large to publish, and on no clean survivor at step 7)"),
    # no replica groups known: the same
    ({1}, _clean(0, 2, 3), {}, "rank 1's per-rank tensors"),
    # HSDP, but rank 1's peer (rank 3) ran an optimizer step after step 7: its pieces are of no boundary
    ({1}, {**_clean(0, 2), 3: Status(3, 7, False)}, HSDP, "rank 1's per-rank tensors"),
    # HSDP, both replicas of shard 1 dead
    ({1, 3}, _clean(0, 2), HSDP, "rank 3's per-rank tensors"),
])
def test_plan_refuses_pieces_no_clean_survivor_holds(dead: set[int], statuses: dict[int, Status],
                                                    replicas: dict, says: str) -> None:
    got = plan(4, dead, statuses, _big(4, 6, 7), replicas=replicas)
    assert not got.ok and says in " | ".join(got.refused), got.refused


def test_plan_keeps_one_writer_when_every_piece_is_published() -> None:
    """DDP, or sharded pieces small enough to publish: the lowest clean survivor writes every shard."""
    snaps = {r: [Snapshot(r, 6), Snapshot(r, 7)] for r in range(4)}
    assert plan(4, {1}, _clean(0, 2, 3), snaps, replicas=HSDP) == Plan(7, 0)


def _hsdp_bound(rank: int, step: int, **own: str) -> Snapshot:
    """HSDP 2x2, every piece published: the sampler the same everywhere, the piece `w` per shard index."""
    changed = frozenset({"entry:sampler", "tensor:w"})
    digests = {"entry:sampler": f"p{step}", "tensor:w": f"w{rank % 2}-{step}", "rng": f"r{rank}-{step}", **own}
    return Snapshot(rank, step, digests=digests, tail_changed=changed)


def _hsdp_window(**rank1_at_6: str) -> dict[int, list[Snapshot]]:
    """Rank 1 published 6 and its tail after 6 (taken before its optimizer step), then died."""
    tail = Snapshot(1, 6, tail_of=6, digests={"entry:sampler": "p6", "tensor:w": "w1-6", "rng": "r1-7"})
    return {0: [_hsdp_bound(0, 6), _hsdp_bound(0, 7)], 1: [_hsdp_bound(1, 6, **rank1_at_6), tail],
            2: [_hsdp_bound(2, 6), _hsdp_bound(2, 7)], 3: [_hsdp_bound(3, 6), _hsdp_bound(3, 7)]}


def test_plan_takes_a_tail_ranks_changed_piece_from_its_replica_peers_memory() -> None:
    """HSDP, rank 1 killed after its optimizer step of step 7: its piece `w` changed at that step and
    differs between shard indices (no survivor's snapshot is its), but its peer rank 3 holds it at 7
    (published the same bytes as rank 1 at 6): rank 3 writes rank 1's shard, `w` from its memory."""
    got = plan(4, {1}, _clean(0, 2, 3), _hsdp_window(), replicas={"w": ((2, 2), (True, False))})
    assert got == Plan(7, 0, spliced=((1, frozenset({"entry:sampler"})),), shards=((1, 3),),
                       from_memory=((1, frozenset({"w"})),))


@pytest.mark.parametrize(("window", "statuses", "replicas"), [
    (_hsdp_window(), _clean(0, 2, 3), {}),  # no replica layout known: `w` is rank 1's alone
    (_hsdp_window(**{"tensor:w": "w1-6-other"}), _clean(0, 2, 3), {"w": ((2, 2), (True, False))}),  # not a replica at 6
])
def test_plan_refuses_a_tail_piece_its_peers_do_not_hold(window: dict, statuses: dict, replicas: dict) -> None:
    got = plan(4, {1}, statuses, window, replicas=replicas)
    assert not got.ok and "rank 1's tensor w at step 7 (set after its optimizer step" in " | ".join(got.refused)


def test_plan_refuses_a_tail_piece_when_its_peer_is_not_clean() -> None:
    got = plan(4, {1}, {**_clean(0, 2), 3: Status(3, 7, False)}, _hsdp_window(), replicas={"w": ((2, 2), (True, False))})
    assert not got.ok and "rank 1's per-rank tensors w (not replicated" in " | ".join(got.refused), got.refused


# -- the writers: a dead rank's specs from a peer's, and a holder that never reports ------------------


def test_a_peers_dtensor_spec_moves_to_the_dead_ranks_coordinate() -> None:
    """HSDP 2x2, a (8, 4) parameter sharded on dim 0: rank 1 writes rank 3's shard (same piece) and
    rank 0's spec for rank 1 (the other piece); a mesh not over every rank in order is refused."""
    import torch

    from slurmresume.train.failwrite import Uncovered, holds, specs_at

    spec = {"shape": [8, 4], "offset": [4, 0], "local_shape": [4, 4], "placements": ["replicate", "shard:0"],
            "mesh_shape": [2, 2], "mesh_arange": True}
    assert specs_at({"w": spec}, 3, 1, 4, {"w": torch.zeros(4, 4)}) == {"w": spec}
    assert specs_at({"w": spec}, 0, 1, 4, {})["w"]["offset"] == [0, 0]
    assert holds(1, 3, "w", {"w": ((2, 2), (True, False))}) and not holds(0, 3, "w", {"w": ((4,), (False,))})
    with pytest.raises(Uncovered, match="placements give"):  # a piece of another shape is not that rank's
        specs_at({"w": spec}, 3, 1, 4, {"w": torch.zeros(2, 4)})
    with pytest.raises(Uncovered, match="not every rank in order"):
        specs_at({"w": {**spec, "mesh_arange": False}}, 3, 1, 4, {})


def test_the_committer_commits_nothing_when_a_holder_died_before_its_report(tmp_path: Path) -> None:
    """A holder assigned rank 3's shard dies before its report: the committer does not wait out its
    budget, and every shard it was to write gets an error report (commit then discards the directory)."""
    import json

    from slurmresume.checkpoint.reports import WriteReport
    from slurmresume.train.failwrite import Writer

    written = WriteReport(1, "x", 4096, "ab" * 8, "cd" * 8, "x.index", 12, "ef" * 8)
    (tmp_path / "report-7-1.json").write_text(json.dumps(written.to_json()))
    writer = Writer(tmp_path, tmp_path / "root", 0, 4, None, None, 7, True, lambda: {3})
    got = writer._reports(7, {1: 1, 3: 3})
    assert got[1] == written and "rank 3 did not write rank 3's shard (it died)" in str(got[3].error)


def test_a_report_file_that_is_not_a_report_stops_the_commit(tmp_path: Path) -> None:
    """A holder's report that lacks what the manifest lists (a torn or foreign file) is an error
    report of that shard, named, not a crash of the committer."""
    from slurmresume.train.failwrite import Writer

    (tmp_path / "report-7-1.json").write_text('{"rank": 1, "error": null, "file": "x"}')
    writer = Writer(tmp_path, tmp_path / "root", 0, 2, None, None, 7, True, lambda: set())
    got = writer._reports(7, {1: 1})
    assert "rank 1's report of rank 1's shard is malformed" in str(got[1].error), got
    assert got[1].file == "rank-00001-of-00002.safetensors"


def test_the_other_writers_follow_the_committers_plan() -> None:
    """What a holder writes comes from the committer's announcement, not from its own plan (the two
    could differ if a status arrived late): the plan survives its JSON round trip."""
    import json

    from slurmresume.train.failwrite import _plan_from, _plan_json

    p = Plan(7, 0, spliced=((1, frozenset({"entry:sampler"})),), shards=((1, 3), (2, 2)),
             from_memory=((1, frozenset({"w"})),))
    assert _plan_from(json.loads(json.dumps(_plan_json(p))), 7, 0) == p


# -- end to end: submit --local, 4 ranks, one SIGKILL placed by step ---------------------------------

STEPS, SAVE_EVERY = 20, 8
HOLD = 12  # test_fsdp2_a_node_lost_steps_after_its_replica_landed...: training waits after this step
ARGS = ["--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--step-sleep", "0.05"]
SCRIPT = HELPERS / "sharded_train.py"


SMALL = ["--hidden", "64"]  # every piece small enough to publish with the step's snapshot


def _submit(root: Path, shape: str, record: Path | None = None, **env: str) -> subprocess.Popen[str]:
    """`shape` is sharded_train.py's --shape, "-small" appended for a model whose pieces are published."""
    extra = {ENV_DRILL_RECORD: str(record)} if record is not None else {}
    args = ["--shape", shape.removesuffix("-small"), *ARGS, *(SMALL if shape.endswith("-small") else ())]
    return subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", str(HELPERS / "unwarned_train.py"),
                             "--ckpt-dir", str(root), "--local", "--nproc-per-node", "4", "--", *args],
                            env=clean_env(UNWARNED_SCRIPT=str(SCRIPT), **extra, **env), cwd=root.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def _kill_at(shape: str, root: Path, seed: int) -> tuple[int, int, Path, str]:
    """The run with one seeded rank stopped in the forward after a seeded step (after the first
    periodic commit), then SIGKILLed with its tree; returns (step, victim, record, output)."""
    rng = random.Random(seed)
    kill_step, victim = rng.randint(SAVE_EVERY + 2, STEPS - 4), rng.randrange(4)
    record = root.parent / "record"
    proc = _submit(root, shape, record, STOP_AFTER_STEP=str(kill_step), STOP_RANK=str(victim))
    end = time.monotonic() + 600
    pid = None
    while pid is None or not _stopped(pid):
        assert proc.poll() is None and time.monotonic() < end, "the run ended before its kill"
        time.sleep(0.02)
        pid = pid or rank_pid(proc.pid, victim)
    signal_tree(pid, signal.SIGKILL)
    return kill_step, victim, record, finish(proc)


def _trained(record: Path) -> int:
    """The last step any rank of the first run completed."""
    first = {r["run"] for r in read_records(record, 0)[:1]}
    return max(r["step"] for rank in range(4) for r in read_records(record, rank) if r["run"] in first)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """An uninterrupted run's last step per shape (run once, when a test first asks)."""
    done: dict[str, Path] = {}

    def get(shape: str) -> Path:
        if shape not in done:
            root = tmp_path_factory.mktemp(f"reference-{shape}") / "root"
            finish(_submit(root, shape))
            done[shape] = root / step_dir_name(STEPS)
        return done[shape]

    return get


@pytest.mark.slow
def test_fsdp2_failure_save_is_refused_naming_the_dead_ranks_pieces(
        tmp_path: Path, reference: Callable[[str], Path]) -> None:
    """FSDP2 over 4 ranks: the dead rank's pieces are on no survivor (and too large to publish):
    the failure save is refused with a line naming them, the job resumes by itself from the
    periodic step and ends bitwise equal to an uninterrupted run."""
    root = tmp_path / "root"
    shape = "fsdp2"
    kill_step, victim, _, out = _kill_at(shape, root, 4702)
    ev = read_events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert len(saves) == 1 and saves[0]["committed"] is False and saves[0]["dead"] == [victim], saves
    missing = " | ".join(saves[0]["missing"])
    assert f"step {kill_step}: rank {victim}'s per-rank tensors " in missing, missing
    assert f"no failure save (missing: step {kill_step}: rank {victim}'s per-rank tensors" in out, out[-3000:]
    assert [e["step"] for e in ev if e["event"] == "restored"] == [SAVE_EVERY]
    assert compare_checkpoints(reference(shape), root / step_dir_name(STEPS)) == []


@pytest.mark.slow
def test_fsdp2_failure_save_of_published_pieces_restores(tmp_path: Path, reference: Callable[[str], Path]) -> None:
    """FSDP2 with pieces small enough to publish: the committer writes every shard, the dead rank's
    pieces from its snapshot, each with that rank's DTensor spec. The code before wrote no DTensor
    specs at all: the committed step did not fit the model on restore and the job gave up (crash loop)."""
    root = tmp_path / "root"
    shape = "fsdp2-small"
    kill_step, victim, _, _ = _kill_at(shape, root, 4702)
    ev = read_events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert [(e["step"], e["committed"], e["dead"]) for e in saves] == [(kill_step, True, [victim])], saves
    assert [e["step"] for e in ev if e["event"] == "restored"] == [kill_step]
    assert compare_checkpoints(reference(shape), root / step_dir_name(STEPS)) == []


@pytest.mark.slow
def test_hsdp_failure_save_commits_from_the_dead_ranks_replica_peer(
        tmp_path: Path, reference: Callable[[str], Path]) -> None:
    """HSDP 2x2: the dead rank's pieces are held by its peer of the other replica, clean at the same
    boundary: the failure save commits (the peer writes the dead rank's shard), the job resumes from
    it with at most one step trained twice, and ends bitwise equal to an uninterrupted run. The code
    before replica peers refused it (the pieces are too large to publish) and repeated every step
    since the periodic save."""
    root = tmp_path / "root"
    shape = "hsdp"
    kill_step, victim, record, _ = _kill_at(shape, root, 4703)
    ev = read_events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert len(saves) == 1 and saves[0]["committed"] is True and saves[0]["dead"] == [victim], saves
    assert saves[0]["step"] == kill_step, saves
    # the dead rank's shard was written by its replica peer (listed when not the committer itself)
    assert (saves[0].get("writers") or {}).get(str(victim), saves[0]["writer"]) == victim ^ 2, saves
    restored = [e["step"] for e in ev if e["event"] == "restored"]
    assert restored == [kill_step], restored
    assert _trained(record) - kill_step <= 1
    assert compare_checkpoints(reference(shape), root / step_dir_name(STEPS)) == []


@pytest.mark.slow
@pytest.mark.exhaustive
def test_hsdp_rank_killed_after_its_optimizer_step_is_covered_by_its_peer(
        tmp_path: Path, reference: Callable[[str], Path]) -> None:
    """HSDP 2x2, rank 1 dies right after its optimizer step of step k, before its ckpt.step(k): its
    tail snapshot holds its RNG and values, and the pieces the step changed (the small ones it
    published too) are its peer rank 3's at k: step k commits, rank 3 writing rank 1's shard."""
    from slurmresume.train.failsave import FINISH_WAIT_S

    root = tmp_path / "root"
    kill_at = random.Random(4704).randint(SAVE_EVERY + 2, STEPS - 4)
    finish(_submit(root, "hsdp", KILL_AT_STEP=str(kill_at), KILL_RANK="1", SURVIVOR_SLEEP=str(FINISH_WAIT_S / 10)))
    ev = read_events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert [(e["step"], e["committed"], e["dead"]) for e in saves] == [(kill_at, True, [1])], saves
    assert (saves[0].get("writers") or {}).get("1") == 3, saves
    assert [e["step"] for e in ev if e["event"] == "restored"] == [kill_at]
    assert compare_checkpoints(reference("hsdp"), root / step_dir_name(STEPS)) == []


@pytest.mark.slow
def test_fsdp2_on_two_nodes_a_killed_rank_costs_at_most_one_step_restored_from_memory(
        tmp_path: Path, reference: Callable[[str], Path]) -> None:
    """Issue 49: FSDP2 over 2 emulated nodes x 2 ranks, `--snapshot-every 1`. Rank 3 (not on rank
    0's node: the rendezvous is reversed) stops once its node's memory snapshot of step k is
    committed and is SIGKILLed. Its pieces are on no survivor, but its node's survivor, rank 2,
    reads and verifies rank 3's shard of exactly step k from the node's memory root and writes it
    into the failure save, which commits step k (train/memshard.py); the restart restores step k,
    so at most one step is trained twice (the periodic step would cost k - 8), and the run ends
    bitwise equal to an uninterrupted one. The code before refused the failure save (rank 3's
    pieces on no survivor) and restored from the memory snapshot every node held."""
    from helpers.twonodes import finish_all, stopped_with_memory

    k = SAVE_EVERY + 3
    root, record = tmp_path / "ckpt", tmp_path / "record"
    env = {"UNWARNED_SCRIPT": str(SCRIPT), "STOP_AFTER_STEP": str(k), "STOP_RANK": "3", "STOP_AFTER_MEMORY": "1",
           ENV_DRILL_RECORD: str(record)}
    launchers, pid, _ = stopped_with_memory(tmp_path, ["--shape", "fsdp2", *ARGS], env, "4950", 3)
    signal_tree(pid, signal.SIGKILL)
    outs = finish_all(launchers, 600)
    assert [p.returncode for p in launchers] == [0, 0], "\n".join(o[-3000:] for o in outs)
    ev = read_events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert [(e["step"], e["committed"], e["dead"], e.get("from_snapshot")) for e in saves] == [(k, True, [3], [3])], \
        saves
    assert (saves[0].get("writers") or {}).get("3") == 2, saves  # rank 3's node's survivor wrote its shard
    assert [e["step"] for e in ev if e["event"] == "restored"] == [k], \
        [e for e in ev if e["event"] in ("restored", "memory_fallback")]
    assert _trained(record) - k <= 1
    assert compare_checkpoints(reference("fsdp2"), root / step_dir_name(STEPS)) == []


@pytest.mark.slow
def test_fsdp2_a_node_lost_whole_is_committed_from_the_peer_copy_and_the_requeued_job_ends_bitwise(
        tmp_path: Path, reference: Callable[[str], Path]) -> None:
    """Issue 49 item 4: FSDP2 over 2 emulated nodes x 2, `--snapshot-every 1`, rank 3 stopped after
    its node's snapshot of step k. Once the other node holds the peer copy of the step the ranks
    pinned for the copy (peerpin.py: k, or k - 1 when k's copy was not due: the one before
    was still being acked) of the node with ranks 2 and 3, that node is lost whole (its launcher,
    torchrun and both ranks SIGKILLed). The survivors' failure save is refused (ranks 2 and 3's
    pieces are on no survivor), but the surviving launcher holds every shard of that step: ranks 0
    and 1's in its memory, ranks 2 and 3's in the verified replica. It commits it to the root
    (`memory_promoted`), the job is requeued, and the requeued job resumes from it (at most two
    steps trained twice, where the periodic step would cost k - 8) and ends bitwise."""
    from helpers.procs import process_tree
    from helpers.twonodes import finish_all, killed_on_failure, requeued, stopped_with_memory

    from slurmresume.checkpoint.layout import MARKER
    from slurmresume.contract import LAUNCHER_EXIT_REQUEUED
    from slurmresume.job.peercopy import replica_root
    from slurmresume.peerpin import read_pins

    k = SAVE_EVERY + 3
    root, record, calls = tmp_path / "ckpt", tmp_path / "record", tmp_path / "scontrol.log"
    env = {"UNWARNED_SCRIPT": str(SCRIPT), "STOP_AFTER_STEP": str(k), "STOP_RANK": "3", "STOP_AFTER_MEMORY": "1",
           ENV_DRILL_RECORD: str(record), "SCONTROL_LOG": str(calls)}
    args = ["--shape", "fsdp2", *ARGS]
    launchers, pid, (mem0, mem1) = stopped_with_memory(tmp_path, args, env, "4951", 3)
    with killed_on_failure(launchers):
        assert pid in process_tree(launchers[0].pid)  # rank 3 is on the node with SLURM_NODEID=0
        end = time.monotonic() + 120  # a hang guard: the copy runs in the background
        target = read_pins(mem0).target
        assert target in (k - 1, k), target
        while not (replica_root(mem1, 0) / step_dir_name(target) / MARKER).exists():
            assert time.monotonic() < end, "the peer copy of the pinned step never arrived"
            time.sleep(0.05)
        signal_tree(launchers[0].pid, signal.SIGKILL)  # the launcher, its torchrun agent and both ranks
        outs = finish_all(launchers, 600)
    assert launchers[1].returncode == LAUNCHER_EXIT_REQUEUED, "\n".join(o[-3000:] for o in outs)
    ev = read_events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert len(saves) == 1 and saves[0]["committed"] is False, saves
    promoted = [e for e in ev if e["event"] == "memory_promoted"]
    assert [(e["step"], e["committed"]) for e in promoted] == [(target, True)], promoted

    # the requeued job: both nodes again, nothing stops any more
    again, outs = requeued(tmp_path, HELPERS / "unwarned_train.py", args, env, "4951")
    assert [p.returncode for p in again] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert [e["step"] for e in read_events(root) if e["event"] == "restored"] == [target]
    assert _trained(record) - target <= 2
    assert compare_checkpoints(reference("fsdp2"), root / step_dir_name(STEPS)) == []


@pytest.mark.slow
def test_fsdp2_a_node_lost_steps_after_its_replica_landed_is_committed_from_the_pinned_snapshot(
        tmp_path: Path, reference: Callable[[str], Path]) -> None:
    """Issue 49 item 4, as the bench loses a node: not stopped at a snapshot but while training runs,
    steps after the other node received a replica of its snapshots. Every node keeps its own
    snapshot of the newest step whose replica every successor acked (peerpin.py), and the
    successor keeps that replica, so the survivor still holds every shard of one step: it is
    committed (`memory_promoted`), at least as new as the replica seen before the kill, and the
    requeued job resumes from it and ends bitwise. (Before the pins, the survivor's own snapshots
    had moved past the one replica it kept, and nothing was promoted.)"""
    from helpers.twonodes import finish_all, killed_on_failure, requeued, stopped_with_memory

    from slurmresume.checkpoint.store import newest_committed
    from slurmresume.contract import LAUNCHER_EXIT_REQUEUED
    from slurmresume.job.peercopy import replica_root

    root, record, go = tmp_path / "ckpt", tmp_path / "record", tmp_path / "go"
    # training waits after step HOLD until a replica newer than the periodic save landed: the copy
    # runs in the background, and on a loaded box it could lag past the end of a 20-step run
    env = {"UNWARNED_SCRIPT": str(SCRIPT), ENV_DRILL_RECORD: str(record), "HOLD_AT_STEP": str(HOLD),
           "HOLD_FILE": str(go)}
    args = ["--shape", "fsdp2", *ARGS]
    launchers, _pid, (_mem0, mem1) = stopped_with_memory(tmp_path, args, env, "4952", None)
    with killed_on_failure(launchers):
        end = time.monotonic() + 300  # a hang guard: the copy runs in the background
        landed = None  # a replica newer than the periodic save: what it promotes beats the file tier
        while landed is None or landed <= SAVE_EVERY:
            assert time.monotonic() < end and all(p.poll() is None for p in launchers), "no replica before the end"
            landed = newest_committed(replica_root(mem1, 0))
            time.sleep(0.01)
        assert landed <= HOLD, landed  # (then the kill below comes at most HOLD + 3 < STEPS)
        go.touch()
        while max((r["step"] for r in read_records(record, 0)), default=0) < landed + 3:
            assert time.monotonic() < end and all(p.poll() is None for p in launchers), "the run ended first"
            time.sleep(0.01)
        signal_tree(launchers[0].pid, signal.SIGKILL)  # the launcher, its torchrun agent and both ranks
        outs = finish_all(launchers, 600)
    assert launchers[1].returncode == LAUNCHER_EXIT_REQUEUED, "\n".join(o[-3000:] for o in outs)
    promoted = [e for e in read_events(root) if e["event"] == "memory_promoted"]
    assert len(promoted) == 1 and promoted[0]["committed"] is True, promoted
    assert promoted[0]["step"] >= landed, (promoted, landed)

    again, outs = requeued(tmp_path, HELPERS / "unwarned_train.py", args, env, "4952")
    assert [p.returncode for p in again] == [0, 0], "\n".join(o[-3000:] for o in outs)
    restored = [e["step"] for e in read_events(root) if e["event"] == "restored"]
    assert restored == [promoted[0]["step"]], restored
    assert compare_checkpoints(reference("fsdp2"), root / step_dir_name(STEPS)) == []


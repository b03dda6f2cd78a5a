"""Two emulated Slurm nodes (n1, n2 on this host), c10d rendezvous across them: preemption,
a hang, a rank killed, a node lost; each saved, resumed and finished, bitwise where it can be.

The full suite starts the cluster with two nodes and these tests share it with the one-node tests;
only the partition preemption holds it alone. On a one-node cluster the module switches it to two
nodes and back, holding it alone meanwhile (the `two_nodes` fixture)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import find_processes, rank_places, reversed_rendezvous_env, signal_tree

from slurmresume.checkpoint.store import find_latest
from slurmresume.tools.compare import compare_checkpoints

from .test_slurm_e2e import (
    REPO,
    count,
    events,
    final_state,
    job_log,
    preempt_at,
    sacct_states,
    scancel,
    submit,
    wait,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes(cluster: None):
    """Two Slurm nodes for this module. The full suite starts the cluster with two (scripts/test):
    nothing to do, and the module's tests share the cluster with the other tests (the other chain's
    one-node jobs land on either node). On a one-node cluster (`bash scripts/cluster.sh up`) the
    module switches it to two and back, restarting the daemons (which kills every other test's job),
    so it holds the cluster alone from the switch until it is back to one."""
    from helpers.cluster_lock import cluster_lock
    from helpers.slurm_probe import node_count

    if node_count() == 2:
        yield
        return
    with cluster_lock(exclusive=True):
        up = subprocess.run(["bash", str(REPO / "scripts" / "cluster.sh"), "up", "--nodes", "2"],
                            capture_output=True, text=True)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        yield
        back = subprocess.run(["bash", str(REPO / "scripts" / "cluster.sh"), "up", "--nodes", "1"],
                              capture_output=True, text=True)
        assert back.returncode == 0, back.stdout[-3000:]


from .test_slurm_e2e import cluster  # noqa: E402,F401  (the module fixture above depends on it)


@pytest.mark.exhaustive  # the 2 x 2 example preempted twice (below) proves a 2-node preemption, requeue and resume
def test_two_nodes_preempt_once(two_nodes: None, tmp_path: Path) -> None:
    root = tmp_path / "run"
    # --shared-root: both emulated nodes run on this host, whose local disk they share
    job = submit(root, "--nodes", "2", "--shared-root", "--nproc-per-node", "1", "--time", "10",
                 script_args=("60", "0.1", "0"))
    preempt_at(root, job, 6, 0, "--signal=USR1")
    assert final_state(job, timeout=300) == "COMPLETED", job_log(root, job)
    assert count(root, "requeued") == 1
    saved = [e["step"] for e in events(root) if e["event"] == "exit_after_save"]
    assert len(saved) == 1
    manifest = json.loads((root / f"step_{saved[0]:09d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    nodes_started = {e.get("node") for e in events(root) if e["event"] == "started"}
    assert nodes_started == {0, 1}
    assert find_latest(root, warn=False).step == 60


HANG_TRAIN = REPO / "tests" / "helpers" / "hang_train.py"


def _submit_env(root: Path, script: Path, args: list[str], script_args: list[str], **env: str) -> str:
    out = subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(script), "--ckpt-dir", str(root),
                          "--json", *args, "--", *script_args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)["job_id"]


def _reversed_nodes(tmp_path: Path, late_s: float) -> Path:
    """A `--python` for submitit's process that makes the rendezvous order the reverse of the Slurm
    order: each node's torchrun agent gets its own spelling of this host, node 1's sorting first
    (helpers.procs.reversed_rendezvous_env), so c10d gives node 1 ranks 0-1 whatever the agents'
    pids. Node 0's launcher also starts `late_s` late. (The late start alone, leaving the order to
    the pids, failed in CI once pids had wrapped.)"""
    n0, n1 = (reversed_rendezvous_env(n)["PET_LOCAL_ADDR"] for n in (0, 1))
    wrapper = tmp_path / "python-nodes-reversed"
    wrapper.write_text("#!/bin/sh\ncase \"$*\" in *submitit.core._submit*)\n"
                       f"  if [ \"$SLURM_NODEID\" = 0 ]; then sleep {late_s}; export PET_LOCAL_ADDR={n0};\n"
                       f"  else export PET_LOCAL_ADDR={n1}; fi;;\nesac\nexec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper


def test_two_nodes_a_hang_on_slurm_node_1_is_caught_and_restarted_in_the_allocation(two_nodes: None,
                                                                                     tmp_path: Path) -> None:
    """2 nodes x 2 ranks, the rendezvous order forced to the reverse of the Slurm order; the rank with
    LOCAL_RANK 1 on SLURM_NODEID 1 stops before step 12's collective. The watch (step budget 4 s via
    --hang-timeout) catches it (within the budget plus scheduling delay), every rank's stacks are dumped, the run restarts
    inside the allocation (no requeue) and the job completes."""
    began = time.monotonic()
    root, piddir = tmp_path / "ckpt", tmp_path / "pids"
    job = _submit_env(root, HANG_TRAIN, ["--nodes", "2", "--shared-root", "--nproc-per-node", "2", "--time", "10",
                                         "--python", str(_reversed_nodes(tmp_path, 4)), "--hang-timeout", "4",
                                         "--hang-startup", "60", "--max-hangs", "1"],
                      ["24", "0.05", "-1", "1", "0", "5"], HANG_ON="1:1:12", PIDDIR=str(piddir))
    assert final_state(job, timeout=300) == "COMPLETED", job_log(root, job)
    where = rank_places(piddir, f"slurm-{job}.0.0")
    print(f"\nrun 0: rank -> (SLURM_NODEID, LOCAL_RANK) {where}; "
          f"the restart: {rank_places(piddir, f'slurm-{job}.0.1')}")
    assert sorted(where) == [0, 1, 2, 3], where
    assert where[0][0] == 1, f"the rendezvous order was not reversed: {where}"
    ev = events(root)
    hangs = [e for e in ev if e["event"] == "hang"]
    assert hangs, job_log(root, job)
    for h in hangs:
        print(f"hang: node {h.get('host')} ranks {h['ranks']} step {h['step']} budget {h['budget_s']} s "
              f"detected {h['detect_latency_s']} s after the last heartbeat")
        assert h["phase"] == "step" and h["step"] == 11, hangs
        # caught by the watch, not by a collective timeout (minutes); how promptly is a benchmark's
        # figure (scripts/bench_hang.py), not a verdict that may depend on this box's load
        assert h["detect_latency_s"] <= h["budget_s"] + 30.0, h
    hung = [r for r, (node, local) in where.items() if (node, local) == (1, 1)]
    assert any(set(hung) <= set(h["ranks"]) for h in hangs), (hung, hangs)
    dumped = {p.name for h in hangs for p in Path(h["dump_dir"]).iterdir()}
    assert dumped == {f"rank-{r}.txt" for r in range(4)}, dumped
    assert [e["cause"] for e in ev if e["event"] == "resumed"] == ["hang"] * 2  # once per node
    assert not any(e["event"] == "requeued" for e in ev)
    assert len(sacct_states(job)) == 1  # one Slurm run: the restart happened inside the allocation
    assert any(e["event"] == "finished" and e["step"] == 24 for e in ev)
    print(f"wall time {time.monotonic() - began:.1f} s")


EXAMPLE = REPO / "examples" / "train.py"
EXAMPLE_STEPS = ("--steps", "30", "--save-every", "5")


def _node_ranks(root: Path, job: str) -> dict[int, list[int]]:
    """SLURM_NODEID -> the global ranks its launcher's hang watch watched in its last run (the
    launcher learns them from its agent's children: the rendezvous order, not the Slurm order)."""
    return {n: sorted(int(r) for r in json.loads((root / ".runs" / f"slurm-{job}.node-{n}.ranks.json").read_text())
                      ["ranks"]) for n in (0, 1)}


@pytest.fixture(scope="module")
def uninterrupted_2x2(two_nodes: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, float]:
    """examples/train.py, 2 nodes x 2 ranks, never interrupted, the rendezvous order reversed, the
    start-up budget shortened to 60 s and 2 s of sleep per step, so that the run lives past it:
    (root, job id, seconds from the first launcher's start to the finish)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    root = tmp / "run"
    job = _submit_env(root, EXAMPLE, ["--nodes", "2", "--shared-root", "--nproc-per-node", "2", "--time", "10",
                                      "--python", str(_reversed_nodes(tmp, 4)), "--hang-startup", "60"],
                      [*EXAMPLE_STEPS, "--step-sleep", "2"])
    assert final_state(job, timeout=400) == "COMPLETED", job_log(root, job)
    ev = events(root)
    started = min(e["time"] for e in ev if e["event"] == "started")
    finished = max(e["time"] for e in ev if e["event"] == "finished")
    return root, job, finished - started


def test_two_nodes_example_lives_past_a_60s_start_up_budget_with_no_hang(
        uninterrupted_2x2: tuple[Path, str, float]) -> None:
    """#26: a healthy 2 x 2 run whose nodes rendezvous in the reverse of their Slurm order is never
    taken for hung (the old watch took the other node's ranks for silent ones and killed the job
    once the start-up budget ran out)."""
    root, job, lived = uninterrupted_2x2
    ranks = _node_ranks(root, job)
    print(f"\nSLURM_NODEID -> ranks: {ranks}; the run lived {lived:.1f} s under a 60 s start-up budget")
    assert ranks == {0: [2, 3], 1: [0, 1]}, f"the rendezvous order was not reversed: {ranks}"
    assert lived > 65, lived
    ev = events(root)
    assert [e for e in ev if e["event"] in ("hang", "held", "failed", "gave_up", "requeued")] == []
    assert count(root, "started") == 2  # one run per node, never restarted
    for n in (0, 1):  # each watch saw its own ranks to the end (not "unknown")
        summary = json.loads((root / ".runs" / f"slurm-{job}.node-{n}.ranks.json").read_text())
        assert summary["watched"] and {r["step"] for r in summary["ranks"].values()} == {30}, summary
    assert find_latest(root, warn=False).step == 30


@pytest.mark.slurm_exclusive  # a `high` job on both nodes would preempt the other tests' jobs too
def test_two_nodes_example_preempted_twice_by_high_partition_ends_bitwise_equal(
        uninterrupted_2x2: tuple[Path, str, float], tmp_path: Path) -> None:
    """#28: examples/train.py (DDP, no DDPBuckets line) on 2 nodes x 2 ranks, preempted twice by a
    `high` job, ends bitwise equal to the uninterrupted 2 x 2 run (DDP's bucket layout at 4 ranks)."""
    began = time.monotonic()
    root = tmp_path / "run"
    job = submit(root, "--partition", "low", "--sbatch", "exclusive", "--nodes", "2", "--shared-root",
                 "--nproc-per-node", "2", "--time", "10", script=EXAMPLE,
                 script_args=(*EXAMPLE_STEPS, "--step-sleep", "0.3"))
    for restart, past in ((0, 5), (1, 15)):
        run = f"slurm-{job}.{restart}."
        wait(lambda past=past, run=run: any(e["event"] == "save_committed" and e["step"] >= past
                                            and str(e.get("run_id", "")).startswith(run) for e in events(root)),
             240, f"run {restart} to commit step {past}\n{job_log(root, job)}")
        high = subprocess.run(["sbatch", "--parsable", "-p", "high", "--exclusive", "-N", "2", "-t", "2",
                               "-o", "/dev/null", "--wrap", "sleep 3"], capture_output=True, text=True,
                              check=True).stdout.strip()
        assert final_state(high, timeout=240) == "COMPLETED"
    assert final_state(job, timeout=400) == "COMPLETED", job_log(root, job)
    print(f"\nSLURM_NODEID -> ranks (last run): {_node_ranks(root, job)}")
    ev = events(root)
    saved = [e["step"] for e in ev if e["event"] == "exit_after_save" and e.get("kind") == "preempt"]
    assert len(saved) == 2, ev
    assert sorted({e["restart"] for e in ev if e["event"] == "started"}) == [0, 1, 2]
    assert [e for e in ev if e["event"] in ("hang", "failed", "gave_up")] == []
    final = find_latest(root, warn=False)
    assert final is not None and final.step == 30
    reference = find_latest(uninterrupted_2x2[0], warn=False)
    assert reference is not None and reference.step == 30
    assert compare_checkpoints(reference.path, final.path) == []
    print(f"preempted at steps {saved}; wall time {time.monotonic() - began:.1f} s")


def _stopped_rank(env_has: tuple[bytes, ...], script: bytes = b"unwarned_train.py", timeout: float = 300) -> int:
    """The pid of the (SIGSTOPped) rank whose environment holds every entry of `env_has`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stopped = find_processes(script, env_has, state="T")
        if stopped:
            return stopped[0]
        time.sleep(0.1)
    raise AssertionError(f"no stopped rank with {env_has} within {timeout:.0f} s")


def test_two_nodes_a_rank_sigkilled_on_the_second_node_costs_at_most_one_step(
        uninterrupted_2x2: tuple[Path, str, float], tmp_path: Path) -> None:
    """#47 on real Slurm, 2 nodes x 2 ranks, no warning: the rank with LOCAL_RANK 1 on
    SLURM_NODEID 0 (rank 3: the rendezvous is reversed, so rank 0 is on the other node) stops in
    the forward of a seeded step and is SIGKILLed. The survivors of both
    nodes commit the failure save (job/deathboard.py), the run resumes inside the allocation (no
    requeue), at most one step is trained twice, the job is COMPLETED and its step 30 is bitwise
    the uninterrupted 2 x 2 run's. Before, a 2-node job had no failure save: it resumed from the
    newest periodic step. With `--snapshot-every 1` (issue 49) the killed rank stops once its node's
    memory snapshot of that step is committed, and the restart restores it from memory (each node
    its own ranks' shards; the failure save holds the same step): the memory tier on real Slurm. Both
    runs rendezvous in one order (helpers.procs.reversed_rendezvous_env): on one host c10d orders
    the nodes by their agents' pids, and a rank moved to the other node restores from the file tier
    (memrestore.common_step), which this test is not about. The stopped rank is on the node without
    rank 0: its node's copy of the step is published last (memtier.finish_node, after a broadcast
    every rank joins), so once it sees its marker every node holds the step; a rank stopped on rank
    0's node as soon as rank 0 commits would leave the other node's copy unfinished (the restart
    then reads the file tier's same step: safe, but not what this test is about)."""
    from slurmresume.contract import ENV_DRILL_RECORD
    from slurmresume.train.steprecord import read_records

    kill_step = random.Random(4702).choice([11, 12, 13])  # never a periodic step (every 5)
    root, record = tmp_path / "run", tmp_path / "record"
    job = _submit_env(root, REPO / "tests" / "helpers" / "unwarned_train.py",
                      ["--nodes", "2", "--shared-root", "--nproc-per-node", "2", "--time", "10", "--no-script-check",
                       "--snapshot-every", "1", "--python", str(_reversed_nodes(tmp_path, 0))],
                      [*EXAMPLE_STEPS, "--step-sleep", "0.2"], STOP_AFTER_STEP=str(kill_step), STOP_NODE="0",
                      STOP_LOCAL_RANK="1", STOP_AFTER_MEMORY="1", SLURMRESUME_MEMORY_BASE=str(_shm(tmp_path)),
                      **{ENV_DRILL_RECORD: str(record)})
    try:
        pid = _stopped_rank((b"SLURM_NODEID=0", b"LOCAL_RANK=1", f"SLURM_JOB_ID={job}".encode()))
        victim = int(next(e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                          if e.startswith(b"RANK="))[5:])
        os.kill(pid, signal.SIGKILL)
    except BaseException:
        scancel(job)
        raise
    assert final_state(job, timeout=400) == "COMPLETED", job_log(root, job)
    ev = events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert len(saves) == 1 and saves[0]["committed"] is True and saves[0]["dead"] == [victim], \
        (saves, job_log(root, job))
    saved = saves[0]["step"]
    assert [(e["step"], e.get("tier")) for e in ev if e["event"] == "restored"] == [(saved, "memory")], \
        [e for e in ev if e["event"] in ("restored", "memory_fallback")]
    first_run = {r["run"] for r in read_records(record, 0)[:1]}
    trained = max(r["step"] for rank in range(4) for r in read_records(record, rank) if r["run"] in first_run)
    print(f"\nrank {victim} killed after step {kill_step}; failure save of step {saved} by rank "
          f"{saves[0]['writer']}; {trained - saved} step(s) trained twice")
    assert trained - saved <= 1, (trained, saved)
    assert not any(e["event"] == "requeued" for e in ev) and len(sacct_states(job)) == 1  # inside the allocation
    ref_root, _, _ = uninterrupted_2x2
    assert compare_checkpoints(ref_root / "step_000000030", root / "step_000000030") == []


def _shm(tmp_path: Path) -> Path:
    """The base of both nodes' memory roots (one host: each node's root is its own directory)."""
    base = tmp_path / "shm"
    base.mkdir()
    base.chmod(0o777)  # the job runs as the submitting user, as every test's job here
    return base


def _launcher(job: str, node: int) -> int:
    """The node launcher (submitit's process) of `job` on SLURM_NODEID `node`."""
    found = find_processes(b"submitit.core._submit", (f"SLURM_NODEID={node}".encode(), f"SLURM_JOB_ID={job}".encode()))
    if not found:
        raise AssertionError(f"no launcher of job {job} on node {node}")
    return found[0]


def test_two_nodes_a_node_lost_whole_is_saved_for_by_the_other_and_slurm_requeues(
        uninterrupted_2x2: tuple[Path, str, float], tmp_path: Path) -> None:
    """#47, a lost node on real Slurm: the launcher of SLURM_NODEID 1 and its whole tree (torchrun,
    both ranks) SIGKILLed after step 10's commit, with no warning. The launcher of node 0 sees its
    ring connection close without a goodbye (job/deathboard.py), its ranks commit the failure save
    with node 1's snapshots from the shared root, and it requeues the job; Slurm requeues it, the
    new run resumes from the failure save, COMPLETED, bitwise. Before: the job sat RUNNING with
    node 0 waiting at a rendezvous node 1 would never join, and nothing was saved at the failure."""
    root = tmp_path / "run"
    job = submit(root, "--nodes", "2", "--shared-root", "--nproc-per-node", "2", "--time", "10", script=EXAMPLE,
                 script_args=(*EXAMPLE_STEPS, "--step-sleep", "0.3"))
    try:
        wait(lambda: any(e["event"] == "save_committed" and e["step"] >= 10 for e in events(root)), 240,
             f"step 10's commit\n{job_log(root, job)}")
        time.sleep(1.0)  # inside the steps after it
        signal_tree(_launcher(job, 1), signal.SIGKILL, top_first=True)  # the launcher first: no goodbye
    except BaseException:
        scancel(job)
        raise
    assert final_state(job, timeout=400) == "COMPLETED", job_log(root, job)
    ev = events(root)
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert len(saves) == 1 and saves[0]["committed"] is True and saves[0]["dead"] in ([0, 1], [2, 3]), \
        (saves, job_log(root, job))  # node 1's ranks, in whatever order the rendezvous gave them
    lost_ranks = saves[0]["dead"]
    saved = saves[0]["step"]
    assert saved > 10
    assert count(root, "requeued") == 1 and "lost" in next(e["reason"] for e in ev if e["event"] == "requeued")
    assert [e["step"] for e in ev if e["event"] == "restored"] == [saved]
    print(f"\nnode 1 (ranks {lost_ranks}) lost after step 10; failure save of step {saved}; requeued; resumed from it")
    ref_root, _, _ = uninterrupted_2x2
    assert compare_checkpoints(ref_root / "step_000000030", root / "step_000000030") == []

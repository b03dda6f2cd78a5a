"""Ownership on a shared file system (issue #27): the same command resumes after a crash when the
previous owner is provably gone; a fresh heartbeat always wins; only the lease's cluster answers
about its job ("Invalid job id" is no proof); a fresh root is leased by the Checkpointer that
creates it; a holder that lost its lease stops. Fakes only at the Slurm seam (commands on PATH)."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.procs import clean_env

from slurmresume import evidence, ownership
from slurmresume.checkpoint.layout import OWNER
from slurmresume.evidence import ALIVE, FRESH, PROVEN, STALE, Facts
from slurmresume.train import claims

NOW = 1_000_000.0
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def _lease(**kw) -> ownership.Lease:
    base = ownership.Lease("slurm-777", "slurm", "777", 4242, "nodeA", NOW - 3600, NOW - 1, "99", "clusterA",
                           "boot-1", 30.0)
    return replace(base, **kw)


def _facts(**kw) -> Facts:
    base = Facts(NOW, "login1", 1, "boot-9", "clusterA", None, None, pid_ns=7, start="55")
    return replace(base, **kw)


LOCAL = {"owner": "local-x", "kind": "local", "job_id": None, "host": "login1", "boot_id": "boot-9", "pid_ns": 7}


@pytest.mark.parametrize(("lease", "facts", "state"), [
    # Slurm: only the lease's cluster answers; "Invalid job id" (no state) is no proof
    ({"heartbeat": NOW - 1}, {"job_state": "COMPLETED"}, FRESH),  # proven, but the heartbeat is fresh: wait
    ({"heartbeat": NOW - 100}, {"job_state": "COMPLETED"}, PROVEN),
    ({"heartbeat": NOW - 100}, {"job_state": "CANCELLED"}, PROVEN),
    ({"heartbeat": NOW - 5000}, {"job_state": "RUNNING"}, ALIVE),  # alive beats a stale heartbeat
    ({"heartbeat": NOW - 5000}, {"job_state": "PENDING"}, ALIVE),
    ({"heartbeat": NOW - 1}, {"job_state": None}, ALIVE),  # Invalid job id + fresh lease: refused
    ({"heartbeat": NOW - 100}, {"job_state": None}, ALIVE),
    ({"heartbeat": NOW - 700}, {"job_state": None}, STALE),  # weak: --takeover
    ({"heartbeat": NOW - 100}, {"cluster": "clusterB", "job_state": "COMPLETED"}, ALIVE),  # another cluster's 777
    ({"heartbeat": NOW - 100, "cluster": ""}, {"job_state": "COMPLETED"}, ALIVE),  # no cluster recorded
    ({"heartbeat": NOW - 700}, {"cluster": None}, STALE),  # no Slurm here
    # local: pid dead in this boot and pid namespace, or reused (start time differs)
    ({**LOCAL, "heartbeat": NOW - 100}, {"pid_start": ""}, PROVEN),
    ({**LOCAL, "heartbeat": NOW - 100}, {"pid_start": "12"}, PROVEN),  # reused pid
    ({**LOCAL, "heartbeat": NOW - 5}, {"pid_start": ""}, FRESH),
    ({**LOCAL, "heartbeat": NOW - 2, "heartbeat_s": 0.5}, {"pid_start": ""}, PROVEN),  # 3 of its own beats
    ({**LOCAL, "heartbeat": NOW - 5000}, {"pid_start": "99"}, ALIVE),
    ({**LOCAL, "heartbeat": NOW - 100, "boot_id": "boot-1"}, {"pid_start": ""}, ALIVE),  # rebooted or same-named
    ({**LOCAL, "heartbeat": NOW - 700, "host": "nodeZ"}, {}, STALE),  # another host: only the heartbeat
    ({**LOCAL, "heartbeat": NOW - 1, "pid": 1, "pid_start": "55"}, {"pid_start": "55"}, PROVEN),  # this very process
    # issue 45: the same pid in another pid namespace (another container) or of an earlier process
    ({**LOCAL, "heartbeat": NOW - 1, "pid": 1, "pid_ns": 8}, {}, ALIVE),  # not "this same process"
    ({**LOCAL, "heartbeat": NOW - 100, "pid": 1, "pid_ns": 8}, {}, ALIVE),  # nor dead: unknown
    ({**LOCAL, "heartbeat": NOW - 700, "pid": 1, "pid_ns": 8}, {}, STALE),  # only the heartbeat: --takeover
    ({**LOCAL, "heartbeat": NOW - 1, "pid": 1}, {"pid_start": "55"}, FRESH),  # an earlier pid 1: proof, wait
    ({**LOCAL, "heartbeat": NOW - 100, "pid": 1}, {"pid_start": "55"}, PROVEN),
    ({**LOCAL, "heartbeat": NOW - 1, "pid": 1, "pid_start": "55", "pid_ns": 0}, {"pid_start": "55"}, ALIVE),
    ({**LOCAL, "heartbeat": NOW - 100, "pid_ns": 0}, {"pid_start": ""}, ALIVE),  # an older lease: no namespace
    ({**LOCAL, "heartbeat": NOW - 700, "pid_ns": 0}, {"pid_start": ""}, STALE),
    ({**LOCAL, "heartbeat": NOW - 100, "host": "clone2"}, {"pid_start": ""}, ALIVE),  # a VM clone: same boot id
    ({**LOCAL, "heartbeat": NOW - 100}, {"pid_start": "", "pid_ns": 0}, ALIVE),  # /proc cannot say here
    ({**LOCAL, "heartbeat": NOW - 100}, {"pid_start": None}, ALIVE),  # hidden (hidepid) or not asked
])
def test_the_evidence_rules(lease: dict, facts: dict, state: str) -> None:
    assert evidence.weigh(_lease(**lease), _facts(**facts)).state == state


def _fake(tmp: Path, monkeypatch: pytest.MonkeyPatch, **scripts: str) -> None:
    bindir = tmp / "fakebin"
    bindir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        script = bindir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.delenv("SLURM_CLUSTER_NAME", raising=False)
    evidence.cluster_name.cache_clear()


INVALID = "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"


def _write_lease(root: Path, lease: ownership.Lease) -> None:
    """Another run's lease, written under the lease's lock as its `acquire` would: without it a
    live holder's heartbeat (read, then rewrite) could put its own lease back over this one."""
    root.mkdir(parents=True, exist_ok=True)
    with ownership._lock(root):
        (root / OWNER).write_text(json.dumps(lease.__dict__))


def test_invalid_job_id_is_no_proof_against_a_fresh_lease(tmp_path, monkeypatch) -> None:
    """Cluster B shares the file system; job 777 of cluster A refreshed its lease a second ago."""
    _fake(tmp_path, monkeypatch, squeue=INVALID, scontrol='[ "$2" = config ] && echo "ClusterName = clusterB" '
          f'&& exit 0; {INVALID}', sacct="true")
    root = tmp_path / "root"
    theirs = replace(_lease(), heartbeat=time.time() - 1, host="nodeA")
    _write_lease(root, theirs)
    with pytest.raises(ownership.RootOwnedError, match="job 777 on host nodeA"):
        claims.for_checkpointer(root)
    with pytest.raises(ownership.RootOwnedError, match="refusing to start a second writer"):
        ownership.acquire(root, "slurm-5", takeover=True)  # not even with --takeover
    assert json.loads((root / OWNER).read_text())["owner"] == "slurm-777"
    # the same lease, silent for 11 minutes: weak evidence, --takeover only
    _write_lease(root, replace(theirs, heartbeat=time.time() - 660))
    with pytest.raises(ownership.RootOwnedError, match="SLURMRESUME_TAKEOVER=1"):
        claims.for_checkpointer(root)
    assert ownership.acquire(root, "slurm-5", takeover=True).owner == "slurm-5"


def test_a_job_ended_on_the_lease_cluster_is_taken_over_without_a_flag(tmp_path, monkeypatch, caplog) -> None:
    _fake(tmp_path, monkeypatch, scontrol='[ "$2" = config ] && echo "ClusterName = clusterA" && exit 0; '
          'echo "JobId=777 JobName=x JobState=CANCELLED Reason=None"', sacct="true")
    root = tmp_path / "root"
    _write_lease(root, replace(_lease(), heartbeat=time.time() - 120))
    with caplog.at_level(logging.WARNING, logger="slurmresume"):
        lease = ownership.acquire(root, "slurm-800")
    assert lease.owner == "slurm-800" and lease.cluster == "clusterA"
    took = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(took) == 1 and "Slurm job 777" in took[0] and "CANCELLED on cluster clusterA" in took[0]


def test_a_dead_local_owner_with_a_fresh_heartbeat_is_waited_out_then_taken(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / "root"
    lease = replace(ownership.new_lease("local-old", pid=dead.pid), pid_start="1", heartbeat_s=0.5)
    _write_lease(root, lease)
    began = time.monotonic()
    assert ownership.acquire(root, "local-new").owner == "local-new"
    assert time.monotonic() - began < 5


BARE = """
import sys, torch
from slurmresume import Checkpointer
ck = Checkpointer(sys.argv[1], handle_signals=False)
print("constructed", flush=True)
if sys.argv[2] == "wait":
    sys.stdin.readline()
ck.save(int(sys.argv[3]), {"w": torch.ones(3)})
print("saved", flush=True)
if sys.argv[2] == "hold":
    sys.stdin.readline()
"""


def test_two_bare_checkpointers_on_a_fresh_root_the_second_is_refused(tmp_path) -> None:
    root = tmp_path / "fresh"  # does not exist: neither Checkpointer finds a lease at start
    env = clean_env()
    second = subprocess.Popen([sys.executable, "-c", BARE, str(root), "wait", "2"], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert second.stdout.readline().strip() == "constructed"
    first = subprocess.Popen([sys.executable, "-c", BARE, str(root), "hold", "1"], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert first.stdout.readline().strip() == "constructed"
        assert first.stdout.readline().strip() == "saved"  # the first save created the root: leased
        assert json.loads((root / OWNER).read_text())["pid"] == first.pid
        _, err = second.communicate("go\n", timeout=120)
        assert second.returncode != 0 and "RootOwnedError" in err and f"local run pid {first.pid}" in err
        assert [p.name for p in root.glob("step_*")] == ["step_000000001"]
    finally:
        first.communicate("done\n", timeout=120)
    assert first.returncode == 0
    assert not (root / OWNER).exists()  # the first freed the root at exit


def test_a_holder_that_lost_its_lease_stops_saving(tmp_path) -> None:
    import torch

    from slurmresume import Checkpointer

    root = tmp_path / "root"
    ck = Checkpointer(root, handle_signals=False)
    try:
        ck.save(1, {"w": torch.ones(2)})
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:  # another live run took the root (by whatever route): this one must not commit there
            _write_lease(root, ownership.new_lease("local-other", pid=other.pid))
            with pytest.raises(ownership.RootOwnedError, match="lost checkpoint root") as err:
                ck.save(2, {"w": torch.ones(2)})
            assert "\n" not in str(err.value)
            with pytest.raises(ownership.RootOwnedError):  # and every later one
                ck.save(3, {"w": torch.ones(2)})
        finally:
            other.kill()
            other.wait()
        assert sorted(p.name for p in root.glob("step_*")) == ["step_000000001"]
        assert json.loads((root / OWNER).read_text())["owner"] == "local-other"
    finally:
        ck.close()


def test_the_launcher_ends_a_run_that_lost_its_root_without_requeue(tmp_path) -> None:
    root = tmp_path / "root"
    env = clean_env(SLURMRESUME_LEASE_HEARTBEAT_S="0.5")
    run = subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", str(EXAMPLE), "--ckpt-dir", str(root),
                            "--local", "--max-failures", "3", "--", "--steps", "100000", "--save-every", "5",
                            "--step-sleep", "0.05"], env=env, text=True, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, cwd=tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        deadline = time.time() + 120
        while not list(root.glob("step_*/COMMITTED")) and time.time() < deadline:
            time.sleep(0.2)
        assert list(root.glob("step_*/COMMITTED")), run.stderr.read() if run.poll() is not None else "no save"
        _write_lease(root, ownership.new_lease("local-other", pid=other.pid))  # another live run has it now
        taken = {p.parent.name for p in root.glob("step_*/COMMITTED")}
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
        other.kill()
        other.wait()
    assert run.returncode != 0 and "lost checkpoint root" in err, err[-3000:]
    later = {p.parent.name for p in root.glob("step_*/COMMITTED")} - taken
    assert len(later) <= 1  # at most the save already in flight when the lease changed hands
    events = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("started") == 1  # no retry, no requeue
    assert json.loads((root / OWNER).read_text())["owner"] == "local-other"  # never released by the loser


RECORDING_SCONTROL = """#!/bin/sh
echo "$@" >> "$FAKE_LOG"
case "$1 $2" in
  "show job") echo "JobId=4343 JobState=RUNNING TimeLimit=01:00:00" ;;
  "show config") echo "ClusterName = c1"; echo "KillWait = 5 sec" ;;
esac
exit 0
"""


def test_a_reused_job_id_never_believes_the_old_jobs_records(tmp_path) -> None:
    """Job 4343 comes back (MaxJobId wrap, another cluster): the old job's "preempted, committed"
    record and its crash-loop record are not this submission's, so a crash at once is a failure
    (by default retried once in the allocation, then the crash-loop rule ends the job), not a requeue."""
    root, bindir, fake_log = tmp_path / "ckpt", tmp_path / "bin", tmp_path / "scontrol.log"
    bindir.mkdir()
    (bindir / "scontrol").write_text(RECORDING_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    import torch

    from slurmresume import Checkpointer

    with Checkpointer(root, handle_signals=False) as old_job:  # the old job's step 5
        old_job.save(5, {"w": torch.ones(2)})
    runs = root / ".runs"
    runs.mkdir(parents=True, exist_ok=True)
    (runs / "slurm-4343.0.0.json").write_text(json.dumps(
        {"run_id": "slurm-4343.0.0", "kind": "preempt", "step": 5, "committed": True, "error": ""}))
    (runs / "slurm-4343.last-run.json").write_text(json.dumps(
        {"job_key": "slurm-4343", "run_id": "slurm-4343.0.0", "kind": "preempted", "action": "requeue",
         "progressed": True, "latest": 5}))
    crash = tmp_path / "crash.py"
    crash.write_text("raise SystemExit(1)\n")
    code = ("from pathlib import Path; from slurmresume.job.config import JobSpec; "
            "from slurmresume.job.node import NodeLauncher; "
            f"NodeLauncher(JobSpec(script=Path({str(crash)!r}), ckpt_dir=Path({str(root)!r})))()")
    env = clean_env(FAKE_LOG=str(fake_log), PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID="4343",
                    SLURM_JOB_NODELIST="localhost", SLURM_NODEID="0", SLURM_NNODES="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode not in (0, 75), out.stderr[-3000:]  # not finished, not requeued
    assert "giving up" in out.stderr, out.stderr[-3000:]
    assert "requeue" not in fake_log.read_text()
    record = json.loads((runs / "slurm-4343.last-run.json").read_text())
    assert record["kind"] == "failed" and record["nonce"]  # this launch's record replaced the stranger's


def test_runs_records_of_other_launches_are_pruned_and_the_crash_loop_record_kept() -> None:
    from slurmresume.contract import RECORDS_KEEP_RUNS, RECORDS_YOUNG_S, plan_record_prune

    now, old = 10_000_000.0, 10_000_000.0 - RECORDS_YOUNG_S - 1
    mine = [(f"slurm-9.{i}.0.json", old - i) for i in range(RECORDS_KEEP_RUNS + 3)]
    entries = [*mine, ("slurm-9.last-run.json", old - 999), ("slurm-9.node-0.ranks.json", old - 999),
               ("slurm-8.0.0.json", old), ("slurm-8.last-run.json", old), ("local-1-ab.0.0.hang.json", old),
               ("slurm-8.1.0.json", now - 5)]  # young: another node may still be writing it
    gone = plan_record_prune(entries, "slurm-9", now)
    assert gone == sorted(["slurm-8.0.0.json", "slurm-8.last-run.json", "local-1-ab.0.0.hang.json",
                           *(n for n, _ in mine[RECORDS_KEEP_RUNS:])])
    assert plan_record_prune(entries, "slurm-9", old) == []  # nothing is old yet


def test_a_bare_holder_that_lost_its_lease_stops_at_the_next_step(tmp_path, monkeypatch) -> None:
    import torch

    from slurmresume import Checkpointer
    from slurmresume.contract import ENV_LEASE_HEARTBEAT

    monkeypatch.setenv(ENV_LEASE_HEARTBEAT, "0.1")
    root = tmp_path / "root"
    ck = Checkpointer(root, handle_signals=False)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ck.save(1, {"w": torch.ones(2)})
        assert ck.step(2, {"w": torch.ones(2)}) is False  # no save due: nothing happens
        _write_lease(root, ownership.new_lease("local-other", pid=other.pid))
        deadline = time.time() + 10
        while not claims.lost(ck._wiring.lease_key) and time.time() < deadline:
            time.sleep(0.05)
        with pytest.raises(ownership.RootOwnedError, match="lost checkpoint root"):
            ck.step(3, {"w": torch.ones(2)})  # no save was due: the step itself stops the run
        assert sorted(p.name for p in root.glob("step_*")) == ["step_000000001"]
    finally:
        other.kill()
        other.wait()
        ck.close()


def _wipe(root: Path) -> None:
    """`rm -rf root` while a Checkpointer's heartbeat (every 0.1 s here) may still be writing its
    lease's temp file into it: a beat that read the lease just before the wipe writes once more,
    and rmdir then meets "Directory not empty" (a user's `rm -rf` would too); the next beat finds
    the lease gone and writes nothing, so the wipe is retried until the directory is gone."""
    import errno
    import shutil

    for _ in range(100):
        try:
            shutil.rmtree(root)
            return
        except OSError as exc:  # (or a temp file renamed away under the walk)
            if exc.errno not in (errno.ENOTEMPTY, errno.ENOENT):
                raise
            if not root.exists():
                return
            time.sleep(0.02)
    raise AssertionError(f"{root} kept being written into")


def test_a_checkpointer_opened_on_a_wiped_root_leases_it_again_and_keeps_it(tmp_path, monkeypatch) -> None:
    """A process that wiped its root (a benchmark's fresh directory, `rm -rf` between experiments)
    while a Checkpointer on it was still open: the next Checkpointer on that root takes the lease
    again instead of sharing a claim whose heartbeat is about to find the lease gone (the old code
    refused its second save, "lost checkpoint root"), and the first one closing later does not free
    the lease the second one still counts on."""
    import torch

    from slurmresume import Checkpointer
    from slurmresume.contract import ENV_LEASE_HEARTBEAT

    monkeypatch.setenv(ENV_LEASE_HEARTBEAT, "0.1")
    root = tmp_path / "root"
    first = Checkpointer(root, handle_signals=False)
    first.save(1, {"w": torch.ones(2)})
    _wipe(root)
    second = Checkpointer(root, handle_signals=False)
    try:
        second.save(2, {"w": torch.ones(2)})
        time.sleep(1.0)  # several heartbeats
        second.save(3, {"w": torch.ones(2)})
        _wipe(root)
        deadline = time.time() + 10
        while not claims.lost(first._wiring.lease_key) and time.time() < deadline:
            time.sleep(0.05)  # this time the heartbeat finds the lease gone before the next open
        third = Checkpointer(root, handle_signals=False)
        third.save(4, {"w": torch.ones(2)})
        first.close()
        second.close()
        time.sleep(0.5)
        third.save(5, {"w": torch.ones(2)})
        assert json.loads((root / OWNER).read_text())["owner"].startswith("local-")
        assert sorted(p.name for p in root.glob("step_*")) == ["step_000000004", "step_000000005"]
        third.close()
        assert not (root / OWNER).exists()  # the last one closing frees the root
    finally:
        first.close()
        second.close()

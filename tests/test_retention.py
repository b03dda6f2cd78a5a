"""Retention: the pure planner (tables + Hypothesis), then the shell on real files, a real
writer racing prune, prunes killed midway, and a lock file swapped for a symlink."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers.core import tiny_state
from helpers.procs import REPO, clean_env
from hypothesis import given, settings
from hypothesis import strategies as st

from slurmresume import Checkpointer, retention
from slurmresume.checkpoint import leftovers
from slurmresume.checkpoint.commit import root_lock
from slurmresume.checkpoint.layout import DELETING_PREFIX, INPROGRESS, LOCK, MARKER, step_dir_name
from slurmresume.checkpoint.store import find_latest, inspect_dir, list_checkpoints
from slurmresume.duration import format_duration, parse_duration
from slurmresume.errors import CheckpointError, ConfigError, UnsafeCheckpointError
from slurmresume.retention import (
    CheckpointRecord,
    RetentionPolicy,
    apply_policy,
    execute,
    plan_prune,
    scan,
)

NOW = 1_000_000.0
OLD = NOW - 10 * 86400  # ten days before NOW


def done(step: int, **metrics: float) -> CheckpointRecord:
    return CheckpointRecord(step, step_dir_name(step), True, True, False, OLD, metrics or None)


def partial(step: int, *, age: float = 86400.0, marker: bool = False, busy: bool = False) -> CheckpointRecord:
    return CheckpointRecord(step, step_dir_name(step), False, marker, busy, NOW - age)


def deleted_steps(plan) -> list[int]:
    return sorted(r.step for r in plan.delete)


# -- policy and duration validation -----------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"keep": 0}, {"keep": -1}, {"keep": True}, {"keep": 1.5}, {"keep": 1, "keep_every": 0},
    {"keep": 1, "mode": "median"}, {"keep": 1, "keep_best": ""},
    {"keep": 1, "remove_incomplete_older_than": -1.0}, {"keep": 1, "remove_incomplete_older_than": math.nan},
    {"keep": 1, "young_threshold": math.inf},
])
def test_policy_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        RetentionPolicy(**kwargs)


@pytest.mark.parametrize("text,seconds", [
    ("90s", 90), ("30m", 1800), ("2h", 7200), ("1d", 86400), ("1w", 604800), ("1h30m", 5400),
    ("1.5h", 5400), ("600", 600), ("0", 0), (" 2H ", 7200), ("0s", 0),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "-1h", "-5", "3y", "h", "1h-5m", "1e5", "nan", "inf", "1..5s", "2 hours"])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError, match="duration|negative|finite"):
        parse_duration(text)


@pytest.mark.parametrize("seconds,text", [(0, "0s"), (59, "59s"), (60, "1m"), (61, "1m 1s"),
                                          (3600, "1h"), (3720, "1h 2m"), (90000, "1d 1h"), (-5, "0s")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


# -- the pure planner: tables -------------------------------------------------------------------

def test_numeric_order_not_string_order():
    """transformers #27138: a string sort ranks '9' above '100' and deletes the newest."""
    recs = [done(100), done(9), done(10)]
    assert deleted_steps(plan_prune(recs, RetentionPolicy(keep=1), NOW)) == [9, 10]
    assert deleted_steps(plan_prune(recs, RetentionPolicy(keep=2), NOW)) == [9]


def test_keep_one_keeps_one():
    """transformers #25129: save_total_limit=1 deleted everything."""
    plan = plan_prune([done(1), done(2), done(3)], RetentionPolicy(keep=1), NOW)
    assert [r.step for r in plan.keep] == [3]
    assert plan.newest is not None and plan.newest.step == 3


def test_incomplete_dirs_are_not_counted():
    """torchtitan: counting unfinished folders let them push out real checkpoints."""
    recs = [partial(400), partial(300, marker=True), partial(250, busy=True), done(200), done(100), done(50)]
    plan = plan_prune(recs, RetentionPolicy(keep=2), NOW)
    assert deleted_steps(plan) == [50]


@pytest.mark.parametrize("policy,expected_deleted", [
    (RetentionPolicy(keep=1, keep_every=10), [5, 15]),
    (RetentionPolicy(keep=2, keep_every=10), [5, 15]),
    (RetentionPolicy(keep=1, keep_best="loss"), [10, 15, 20]),
    (RetentionPolicy(keep=1, keep_best="loss", mode="max"), [5, 10, 15]),
    (RetentionPolicy(keep=1, keep_best="acc", mode="max"), [5, 10, 15, 20]),
    (RetentionPolicy(keep=5), []),
])
def test_keep_every_and_best(policy, expected_deleted):
    recs = [done(5, loss=0.1), done(10, loss=0.5), done(15, loss=0.3), done(20, loss=0.9), done(25, loss=0.4, acc=1)]
    assert deleted_steps(plan_prune(recs, policy, NOW)) == expected_deleted


def test_best_ignores_nan_bool_and_missing_and_ties_go_to_newest():
    recs = [done(1, loss=math.nan), done(2, loss=True), done(3), done(4, loss=0.2), done(5, loss=0.2), done(9, loss=1)]
    plan = plan_prune(recs, RetentionPolicy(keep=1, keep_best="loss"), NOW)
    assert plan.best is not None and plan.best.step == 5
    assert deleted_steps(plan) == [1, 2, 3, 4]


def test_numpy_metric_values_count():
    recs = [done(1, loss=np.float32(0.1)), done(2, loss=np.int64(3)), done(3, loss=np.bool_(False))]
    plan = plan_prune(recs, RetentionPolicy(keep=1, keep_best="loss"), NOW)
    assert plan.best is not None and plan.best.step == 1 and deleted_steps(plan) == [2]


def test_dotted_metric_path():
    recs = [CheckpointRecord(1, "step_000000001", True, True, False, OLD, {"eval": {"loss": 0.1}}), done(2, x=1)]
    plan = plan_prune(recs, RetentionPolicy(keep=1, keep_best="eval.loss"), NOW)
    assert plan.best is not None and plan.best.step == 1 and deleted_steps(plan) == []


def test_missing_metric_is_flagged_not_guessed():
    plan = plan_prune([done(1, loss=1), done(2, loss=2)], RetentionPolicy(keep=1, keep_best="acc"), NOW)
    assert plan.missing_metric and plan.best is None and deleted_steps(plan) == [1]
    assert not plan_prune([], RetentionPolicy(keep=1, keep_best="acc"), NOW).missing_metric


@pytest.mark.parametrize("record,policy,deleted", [
    (partial(7, age=86400), RetentionPolicy(keep=1), False),  # never without the option
    (partial(7, age=86400), RetentionPolicy(keep=1, remove_incomplete_older_than=3600), True),
    (partial(7, age=1800), RetentionPolicy(keep=1, remove_incomplete_older_than=3600), False),
    (partial(7, age=300), RetentionPolicy(keep=1, remove_incomplete_older_than=0), False),  # young
    (partial(7, age=300), RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=60), True),
    (partial(7, age=86400, busy=True), RetentionPolicy(keep=1, remove_incomplete_older_than=0), False),
    (partial(7, age=86400, marker=True), RetentionPolicy(keep=1, remove_incomplete_older_than=60), True),
    (partial(7, age=-50), RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0), False),
])
def test_incomplete_rules(record, policy, deleted):
    plan = plan_prune([record, done(1)], policy, NOW)
    assert (record in plan.delete) is deleted
    assert plan.newest is not None and plan.newest.step == 1


def test_every_record_has_one_decision_with_a_reason():
    recs = [done(3), partial(2), done(1)]
    plan = plan_prune(recs, RetentionPolicy(keep=1), NOW)
    assert sorted(d.record.step for d in plan.decisions) == [1, 2, 3]
    assert [d.record.step for d in plan.decisions] == [3, 2, 1]
    assert all(d.reasons for d in plan.decisions)


# -- the pure planner: properties ---------------------------------------------------------------

@st.composite
def records(draw):
    steps = draw(st.lists(st.one_of(st.sampled_from([0, 9, 10, 99, 100, 101, 1000]),
                                    st.integers(0, 10**9)), unique=True, max_size=25))
    out = []
    for step in steps:
        kind = draw(st.sampled_from(["complete", "complete", "incomplete", "corrupt", "inflight"]))
        mtime = NOW - draw(st.floats(-100, 30 * 86400))
        loss = draw(st.one_of(st.none(), st.floats(allow_nan=True), st.integers(-5, 5)))
        metrics = None if loss is None else {"loss": loss}
        out.append(CheckpointRecord(step, step_dir_name(step), kind == "complete", kind in ("complete", "corrupt"),
                                    kind == "inflight", mtime, metrics if kind == "complete" else None))
    return out


policies = st.builds(
    RetentionPolicy, keep=st.integers(1, 6), keep_every=st.one_of(st.none(), st.integers(1, 50)),
    keep_best=st.one_of(st.none(), st.just("loss")), mode=st.sampled_from(["min", "max"]),
    remove_incomplete_older_than=st.one_of(st.none(), st.floats(0, 40 * 86400)),
    young_threshold=st.floats(0, 86400))


def expected_complete_keep(recs, policy):
    """An independent statement of what must survive among complete records."""
    complete = sorted((r for r in recs if r.complete), key=lambda r: r.step, reverse=True)
    keep = {r.step for r in complete[: policy.keep]}
    if policy.keep_every:
        keep |= {r.step for r in complete if r.step % policy.keep_every == 0}
    if policy.keep_best:
        scored = [(r.metrics["loss"], r.step) for r in complete if r.metrics
                  and not isinstance(r.metrics["loss"], bool) and math.isfinite(r.metrics["loss"])]
        if scored:
            pick = (min if policy.mode == "min" else max)(v for v, _ in scored)
            keep.add(max(s for v, s in scored if v == pick))
    return keep


@settings(max_examples=400, deadline=None)
@given(records(), policies)
def test_plan_properties(recs, policy):
    plan = plan_prune(recs, policy, NOW)
    deleted = {r.name for r in plan.delete}
    assert sorted(d.record.name for d in plan.decisions) == sorted(r.name for r in recs)
    complete = [r for r in recs if r.complete]
    if complete:
        newest = max(complete, key=lambda r: r.step)
        assert plan.newest == newest and newest.name not in deleted
    if plan.best is not None:
        assert plan.best.name not in deleted
    assert {r.step for r in complete if r.name not in deleted} == expected_complete_keep(recs, policy)
    for r in recs:
        if r.complete:
            continue
        idle = NOW - r.mtime
        limit = policy.remove_incomplete_older_than
        protected = r.in_progress or idle < policy.young_threshold or limit is None or idle < limit
        assert (r.name in deleted) is not protected, r
    survivors = [r for r in recs if r.name not in deleted]
    assert plan_prune(survivors, policy, NOW).delete == ()  # idempotent


@settings(max_examples=200, deadline=None)
@given(records(), policies)
def test_incomplete_records_never_change_decisions_on_complete(recs, policy):
    only_complete = [r for r in recs if r.complete]
    with_all = {d.record.name: d.delete for d in plan_prune(recs, policy, NOW).decisions if d.record.complete}
    alone = {d.record.name: d.delete for d in plan_prune(only_complete, policy, NOW).decisions}
    assert with_all == alone


# -- the shell, on real checkpoints -------------------------------------------------------------

def save(root: Path, *steps: int, loss=None) -> None:
    ckpt = Checkpointer(root, handle_signals=False)
    for s in steps:
        ckpt.save(s, tiny_state(s), metrics={"loss": loss(s) if loss else 1.0 / (s + 1)})
    ckpt.close()


def make_partial(root: Path, step: int, age: float, note: dict | None = None) -> Path:
    d = root / step_dir_name(step)
    d.mkdir(parents=True)
    (d / "rank-00000-of-00001.safetensors").write_bytes(b"\0" * 100)
    if note is not None:
        (d / INPROGRESS).write_text(json.dumps(note))
    t = time.time() - age
    for p in [*d.iterdir(), d]:
        os.utime(p, (t, t), follow_symlinks=False)
    return d


def steps_on_disk(root: Path) -> list[int]:
    return sorted(i.step for i in list_checkpoints(root))


def test_execute_deletes_per_plan_and_cleans_leftovers(tmp_path):
    save(tmp_path, 9, 10, 100)
    (tmp_path / f"{DELETING_PREFIX}step_000000003.abcd").mkdir()
    (tmp_path / f"{DELETING_PREFIX}step_000000003.abcd" / "x").write_text("x")
    result = execute(tmp_path, RetentionPolicy(keep=1))
    assert sorted(result.deleted) == ["step_000000009", "step_000000010"]
    assert steps_on_disk(tmp_path) == [100]
    assert result.cleaned and not list(tmp_path.glob(f"{DELETING_PREFIX}*"))
    assert (tmp_path / "events.jsonl").exists()
    assert execute(tmp_path, RetentionPolicy(keep=1)).deleted == []  # idempotent on disk


def test_execute_deletes_only_what_was_approved_and_still_planned(tmp_path):
    save(tmp_path, 1, 2, 3, 4)
    old = make_partial(tmp_path, 50, age=7200)
    policy = RetentionPolicy(keep=1, remove_incomplete_older_than=3600)
    plan = plan_prune(scan(tmp_path), policy, time.time())
    assert {r.step for r in plan.delete} == {1, 2, 3, 50}
    os.utime(old)  # touched after the plan was shown: the re-check inside the lock keeps it
    result = execute(tmp_path, policy, approved={step_dir_name(2), step_dir_name(50)})
    assert result.deleted == [step_dir_name(2)]
    assert [n for n, _ in result.skipped] == [step_dir_name(50)]
    assert steps_on_disk(tmp_path) == [1, 3, 4, 50]


def test_inprogress_note_protects_while_its_writer_lives(tmp_path):
    save(tmp_path, 1)
    me = {**json.loads(leftovers.note()), "started": 0}  # pid, start time, pid namespace, boot
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    make_partial(tmp_path, 10, age=86400, note=me)
    make_partial(tmp_path, 11, age=86400, note={**me, "pid": dead.pid})
    make_partial(tmp_path, 12, age=86400, note={**me, "host": "some-other-node", "boot_id": "its-boot"})
    make_partial(tmp_path, 13, age=86400, note=None)
    recs = {r.step: r for r in scan(tmp_path)}
    assert (recs[10].in_progress, recs[11].in_progress, recs[12].in_progress, recs[13].in_progress) == (
        True, False, True, False)
    result = execute(tmp_path, RetentionPolicy(keep=1, remove_incomplete_older_than=3600))
    assert sorted(result.deleted) == [step_dir_name(11), step_dir_name(13)]


def test_activity_inside_an_old_directory_counts_as_young(tmp_path):
    save(tmp_path, 1)
    d = make_partial(tmp_path, 5, age=86400)
    os.utime(d / "rank-00000-of-00001.safetensors")  # a shard still streaming
    assert execute(tmp_path, RetentionPolicy(keep=1, remove_incomplete_older_than=0)).deleted == []


def test_step_dir_symlink_is_removed_without_following(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    save(root, 1)
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (root / step_dir_name(7)).symlink_to(outside, target_is_directory=True)
    result = execute(root, RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0))
    assert result.deleted == [step_dir_name(7)]
    assert (outside / "precious").read_text() == "keep me"
    assert not list(root.glob(f"{DELETING_PREFIX}*")) and steps_on_disk(root) == [1]


@pytest.mark.parametrize("target_kind", ["file-outside", "marker-of-newest", "dangling"])
def test_lock_symlink_is_refused_and_nothing_deleted(tmp_path, target_kind):
    root = tmp_path / "root"
    save(root, 1, 2, 3)
    lock = root / LOCK
    lock.unlink(missing_ok=True)
    target = {"file-outside": tmp_path / "victim", "marker-of-newest": root / step_dir_name(3) / MARKER,
              "dangling": tmp_path / "nowhere"}[target_kind]
    if target_kind == "file-outside":
        target.write_text("secret")
    before = target.read_bytes() if target.exists() else None
    lock.symlink_to(target)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        execute(root, RetentionPolicy(keep=1))
    assert steps_on_disk(root) == [1, 2, 3]
    assert (target.read_bytes() if target.exists() else None) == before
    assert find_latest(root).step == 3


def test_filelock_itself_refuses_a_symlinked_lock(tmp_path, monkeypatch):
    """What filelock (>= 3.20.3) does when the link appears after our check: ELOOP, target untouched."""
    (tmp_path / "victim").write_text("secret")
    (tmp_path / LOCK).symlink_to(tmp_path / "victim")
    with pytest.raises(OSError) as info:
        root_lock(tmp_path, timeout=0.5).acquire()
    assert info.value.errno == errno.ELOOP
    assert (tmp_path / "victim").read_text() == "secret"
    # Skip our own pre-check, as if the link appeared just after it: filelock's refusal fires.
    monkeypatch.setattr(retention, "_refuse_odd_lock", lambda path: None)
    with pytest.raises(UnsafeCheckpointError, match="symbolic link"):
        execute(tmp_path, RetentionPolicy(keep=1))
    assert (tmp_path / "victim").read_text() == "secret"


def test_busy_lock_times_out_without_deleting(tmp_path):
    save(tmp_path, 1, 2)
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys,time; from filelock import FileLock; l=FileLock(sys.argv[1]); l.acquire();"
        "print('held', flush=True); time.sleep(30)"), str(tmp_path / LOCK)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match="held"):
            execute(tmp_path, RetentionPolicy(keep=1), lock_timeout=0.2)
    finally:
        holder.kill()
        holder.wait()
    assert steps_on_disk(tmp_path) == [1, 2]


def test_missing_root_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        execute(tmp_path / "nope", RetentionPolicy(keep=1))


def test_checkpointer_applies_the_policy_after_each_commit(tmp_path, caplog):
    ckpt = Checkpointer(tmp_path, handle_signals=False, retention=RetentionPolicy(keep=2, keep_best="acc"))
    for s in (1, 2, 3, 4, 5):
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0})
    assert steps_on_disk(tmp_path) == [4, 5]
    assert "no complete checkpoint records metric 'acc'" in caplog.text
    with pytest.raises(ConfigError):
        apply_policy(tmp_path, {"keep": 1})  # type: ignore[arg-type]


# -- prune racing a real writer process ---------------------------------------------------------

WRITER = """
import sys, pathlib, torch
sys.path.insert(0, sys.argv[3])
from helpers.core import tiny_state
from slurmresume import Checkpointer
root, stop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
ck = Checkpointer(root, handle_signals=False)
step = 0
while not stop.exists():
    step += 1
    state = {**tiny_state(step), "big": torch.full((1 << 20,), float(step))}
    path = ck.save(step, state, metrics={"loss": 1.0 / step})
    assert (path / "COMMITTED").exists(), path
    print(step, flush=True)
"""


class _NoLock:
    def acquire(self):
        return self

    def release(self):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["lock+marker", "age-only"])
def test_prune_racing_a_writer(tmp_path, monkeypatch, variant):
    """`lock+marker`: the lock works and young_threshold=0, so only the .inprogress note keeps
    the writer's directory alive. `age-only`: lock and note both ignored (NFS, Lustre
    localflock, a foreign host): the age threshold alone must protect it."""
    if variant == "lock+marker":
        policy = RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0)
    else:
        policy = RetentionPolicy(keep=1, remove_incomplete_older_than=0)
        monkeypatch.setattr(retention, "root_lock", lambda root, timeout: _NoLock())
        monkeypatch.setattr(leftovers, "writer_dead", lambda directory: True)
    root, stop = tmp_path / "root", tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(stop), str(REPO / "tests")],
                              env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "1", writer.stderr.read()
        deadline, rounds, deleted = time.time() + 2.0, 0, 0
        while time.time() < deadline:
            before = find_latest(root, warn=False)
            deleted += len(execute(root, policy).deleted)
            after = find_latest(root, warn=False)
            assert after is not None and before is not None and after.step >= before.step
            rounds += 1
    finally:
        stop.touch()
        out, err = writer.communicate(timeout=60)
    assert writer.returncode == 0, err
    assert rounds > 5 and deleted > 0
    last = int(out.split()[-1])
    assert find_latest(root, warn=False).step == last
    for info in list_checkpoints(root):
        if info.has_marker:
            assert info.complete, info.problem
            state = tiny_state(0)
            Checkpointer(root, handle_signals=False).restore(state, step=info.step)
            assert state["step"] == info.step


# -- prune killed midway ------------------------------------------------------------------------

# Pruning needs no torch: load the package without its __init__ (which imports torch), so each
# killed child starts in well under a second.
PRUNER = """
import importlib.util, os, shutil, signal, sys, types
pkg = types.ModuleType("slurmresume")
pkg.__path__ = list(importlib.util.find_spec("slurmresume").submodule_search_locations)
sys.modules["slurmresume"] = pkg
from slurmresume.retention import RetentionPolicy, execute
assert "torch" not in sys.modules
files_left = int(sys.argv[2])
if files_left:
    def dying_rmtree(path, ignore_errors=False):  # SIGKILL after removing N files in total
        global files_left
        for name in sorted(os.listdir(path), reverse=True):  # the marker last: worst case
            os.unlink(os.path.join(path, name))
            files_left -= 1
            if files_left == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        os.rmdir(path)
    shutil.rmtree = dying_rmtree
print("start", flush=True)
execute(sys.argv[1], RetentionPolicy(keep=1))
"""


def assert_no_half_checkpoints(root: Path) -> None:
    for info in list_checkpoints(root):
        if (info.path / MARKER).exists():
            assert inspect_dir(info.step, info.path, verify=True).complete, info.path


@pytest.mark.parametrize("kill", ["rename.delete:3", "fsyncdir.delete:3", "rmtree:1", "rmtree:6", "timer:0.01"])
def test_prune_killed_midway_leaves_only_whole_checkpoints(tmp_path, kill):
    """SIGKILL before a rename, between rename and rmtree, inside rmtree, or at a random time."""
    save(tmp_path, *range(1, 21))
    how, _, arg = kill.partition(":")
    env = clean_env()
    if how in ("rename.delete", "fsyncdir.delete"):
        env["SLURMRESUME_TEST_KILL_AT"] = kill
    proc = subprocess.Popen([sys.executable, "-c", PRUNER, str(tmp_path), arg if how == "rmtree" else "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "start"
    if how == "timer":
        time.sleep(float(arg))
        proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    if how != "timer":
        assert proc.returncode == -signal.SIGKILL
    if how in ("fsyncdir.delete", "rmtree"):
        assert list(tmp_path.glob(f"{DELETING_PREFIX}*"))  # killed with a deletion half done
    assert_no_half_checkpoints(tmp_path)
    assert find_latest(tmp_path, warn=False).step == 20
    execute(tmp_path, RetentionPolicy(keep=1))  # a later prune finishes the job
    assert steps_on_disk(tmp_path) == [20]
    assert not list(tmp_path.glob(f"{DELETING_PREFIX}*"))


def test_a_marked_save_directory_not_yet_published_is_kept_while_its_writer_runs(tmp_path: Path) -> None:
    """Between writing COMMITTED and its publishing rename, a save's private directory is a whole
    checkpoint under a `.saving.*` name with its `.inprogress` note still inside. A prune that
    saw it then (young_threshold=0) must keep it: its writer (this process) is alive. The race
    test above hits this window by chance; this one stands in it."""
    from helpers.core import save_steps

    root = tmp_path / "root"
    save_steps(root, [1]).close()
    staged = root / ".saving.step_000000001.0123456789abcdef"
    (root / step_dir_name(1)).rename(staged)  # a committed step 1 under its save's private name
    (staged / INPROGRESS).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 0}))
    save_steps(root, [2]).close()
    policy = RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0)
    assert execute(root, policy).deleted == []
    assert staged.is_dir() and (staged / MARKER).exists()
    (staged / INPROGRESS).unlink()  # writer gone without publishing: litter once past the floor
    old = time.time() - retention.SAVE_DIR_FLOOR_S - 1
    for p in [staged, *staged.iterdir()]:
        os.utime(p, (old, old))
    assert execute(root, policy).deleted == [staged.name]


def test_a_save_directory_without_its_note_yet_is_kept_whatever_the_young_threshold(tmp_path: Path) -> None:
    """A save makes its private directory, then writes the `.inprogress` note into it. When the
    root lock is stuck (a node-local flock, a symlinked lock file) the save goes on without it,
    and a prune with young_threshold=0 that scanned between the two calls deleted the directory
    under the writer (#48: test_concurrency_campaign). A note-less save directory is kept for
    SAVE_DIR_FLOOR_S whatever the policy says; older, it is litter like before."""
    from helpers.core import save_steps

    root = tmp_path / "root"
    save_steps(root, [1]).close()
    fresh = root / ".saving.step_000000002.0123456789abcdef"
    fresh.mkdir()  # the note is not written yet
    policy = RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0)
    assert execute(root, policy).deleted == []
    assert fresh.is_dir()
    old = time.time() - retention.SAVE_DIR_FLOOR_S - 1
    os.utime(fresh, (old, old))
    assert execute(root, policy).deleted == [fresh.name]


@pytest.mark.parametrize("via", ["prune", "library"])
def test_a_truncated_newest_step_never_costs_an_older_intact_one(tmp_path: Path, via: str) -> None:
    """Only steps whose shard sizes match their manifest count toward --keep: with the newest
    step's shard cut short, `prune --keep 1` (and the library's policy after a commit) keeps the
    newest intact step, deletes what is older than it, and leaves the damaged one to the rules
    for corrupt steps (kept: no --remove-incomplete-older-than)."""
    from typer.testing import CliRunner

    from slurmresume.cli import app

    save(tmp_path, 1, 2, 3)
    shard = tmp_path / step_dir_name(3) / "rank-00000-of-00001.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    if via == "prune":
        env = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""}
        r = CliRunner().invoke(app, ["prune", "--keep", "1", "--yes", "--ckpt-dir", str(tmp_path)], env=env)
        assert r.exit_code == 0, r.output
        assert "step_000000003 keep corrupt" in " ".join(r.output.split()), r.output  # not counted
    else:
        result = apply_policy(tmp_path, RetentionPolicy(keep=1))
        assert result.deleted == [step_dir_name(1)]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [step_dir_name(2), step_dir_name(3)]
    assert find_latest(tmp_path).step == 2  # type: ignore[union-attr]

"""A process SIGKILLed in the middle of its 2nd save (before that save's directory is published
as step_000000002): restore never sees the partial save (it lives in the save's own hidden
`.saving.*` directory) and loads the previous complete checkpoint; saving that step again later
publishes a complete step 2; the killed save's directory is removed by the next prune that asks.

The kills go through the test-only fault seam of slurmresume/checkpoint/fsio.py
(SLURMRESUME_TEST_KILL_AT="label:N"). The label list is checked against a trace of a real save
(SLURMRESUME_TEST_TRACE), so a new durability step without a crash test fails here."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path

import pytest
from helpers.core import model_equal, restore_fresh, save_steps, step_dir, tiny_model
from helpers.procs import HELPERS, check, clean_env, run_python

from slurmresume.checkpoint.layout import INPROGRESS, MANIFEST, MARKER, saving_dirs, shard_name
from slurmresume.checkpoint.store import find_latest, inspect_dir, list_checkpoints
from slurmresume.contract import ENV_LEASE_HEARTBEAT
from slurmresume.retention import SAVE_DIR_FLOOR_S, RetentionPolicy, execute

# One worker runs this module, so that its module-scoped fixture (a multi-process run) is
# computed once: under xdist each worker that got one of its tests computed it again.
pytestmark = pytest.mark.xdist_group("core_crash")

# Every label a save crosses before (and including) the rename that publishes it, in order.
KILL_LABELS = [
    "write.inprogress", "fsync.inprogress", "rename.inprogress", "fsyncdir.inprogress",
    "fsyncdir.root", "write.shard.header", "write.shard.data", "fsync.shard",
    "write.index", "fsync.index", "rename.index", "rename.shard",  # the index is written while the shard's fsync runs
    "write.manifest", "fsync.manifest", "rename.manifest", "fsyncdir.manifest",
    "write.marker", "fsync.marker", "rename.marker", "fsyncdir.marker", "unlink.inprogress",
    "fsyncdir.step", "rename.publish",
]
# Labels after which the save's own directory already holds its marker (still unpublished).
AFTER_MARKER = {"fsyncdir.marker", "unlink.inprogress", "fsyncdir.step", "rename.publish"}
# (label, which crossing within the 2nd save): also the last data write of the tensor stream
# (the same as the first when the writer needs only one write for this small shard). The step
# directory is fsynced once, by rank 0 after the marker: a rank does not fsync it after its shard
# (the manifest's directory fsync makes every shard's rename durable before the marker).
CASES: list[tuple[str, int | str]] = ([(label, 1) for label in KILL_LABELS]
                                      + [("write.shard.data", "last")])


def _split_saves(trace: list[str]) -> list[list[str]]:
    saves: list[list[str]] = []
    for label in trace:
        if label == "write.inprogress":
            saves.append([])
        if saves:  # labels before the first save (the root's lease) are not part of a save
            saves[-1].append(label)
    return saves


@pytest.fixture(scope="module")
def traced_save(tmp_path_factory: pytest.TempPathFactory) -> list[list[str]]:
    """Labels crossed by two saves in a fresh process (the seam read from the environment)."""
    tmp = tmp_path_factory.mktemp("trace")
    trace = tmp / "trace.txt"
    proc = run_python([HELPERS / "save_steps.py", tmp / "root", 1, 2],
                      env=clean_env(SLURMRESUME_TEST_TRACE=str(trace)))
    check(proc)
    saves = _split_saves(trace.read_text().split())
    assert len(saves) == 2 and saves[0] == saves[1], saves
    return saves


def _nth(first_save: list[str], label: str, k: int | str) -> int:
    """N for SLURMRESUME_TEST_KILL_AT so that the kill lands at the k-th (or the last) crossing
    of `label` within the 2nd save (the seam counts prefix matches across the whole process)."""
    crossings = sum(1 for x in first_save if x.startswith(label))
    k = crossings if k == "last" else int(k)
    assert 1 <= k <= crossings, (label, k, first_save)
    return crossings + k


def test_kill_labels_cover_every_step_before_the_marker(traced_save: list[list[str]]) -> None:
    first = traced_save[0]
    upto = first[: first.index("rename.publish") + 1]
    assert list(dict.fromkeys(upto)) == KILL_LABELS
    assert upto.count("fsyncdir.step") == 1
    # and after the publishing rename only the root's fsync remains
    assert first[first.index("rename.publish") + 1:] == ["fsyncdir.root"]


@pytest.fixture(scope="module")
def killed_roots(tmp_path_factory: pytest.TempPathFactory, traced_save: list[list[str]]) -> dict:
    """One root per case, each left behind by a process killed during its save of step 2.
    All kills run in one helper process that forks a child per case (imports torch once)."""
    tmp = tmp_path_factory.mktemp("kills")
    jobs = []
    for label, k in CASES:
        name = f"{label}-{k}"
        # A killed child's lease beats every 0.1 s (the floor): the first case's restore waits
        # 0.5 s for its fresh heartbeat to age, not up to 90 s at the default 30 s interval.
        jobs.append({"root": str(tmp / name), "steps": [1, 2], "stdout": str(tmp / f"{name}.out"),
                     "env": {"SLURMRESUME_TEST_KILL_AT": f"{label}:{_nth(traced_save[0], label, k)}",
                             ENV_LEASE_HEARTBEAT: "0.1"}})
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = check(run_python([HELPERS / "kill_matrix.py", tmp / "jobs.json"], timeout=300))
    results = json.loads(proc.stdout)
    return {(label, k): r for (label, k), r in zip(CASES, results, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize(("label", "k"), CASES, ids=[f"{lb}-{k}" for lb, k in CASES])
def test_kill_mid_save_falls_back_then_resave_replaces(
    killed_roots: dict, label: str, k: int | str, caplog: pytest.LogCaptureFixture
) -> None:
    r = killed_roots[(label, k)]
    root = Path(r["root"])
    assert r["signal"] == signal.SIGKILL, r
    assert "saved 1" in r["stdout"] and "saved 2" not in r["stdout"], r["stdout"]

    assert not step_dir(root, 2).exists(), "an unpublished save is visible as step 2"
    [(step2, partial)] = saving_dirs(root)
    assert step2 == 2 and partial.name.startswith(".saving.step_000000002.")
    assert (partial / MARKER).exists() == (label in AFTER_MARKER)
    after_note = label.endswith("inprogress") or label in ("rename.publish", "fsyncdir.step")
    assert (partial / INPROGRESS).exists() or after_note
    assert [i.step for i in list_checkpoints(root)] == [1]
    second_copy = (partial / MARKER).exists() and not (partial / INPROGRESS).exists()  # committed, unpublished

    caplog.set_level(logging.WARNING, logger="slurmresume")
    step, state = restore_fresh(root)
    assert step == 1
    assert model_equal(state["model"], tiny_model(1))
    assert state["step"] == 1 and state["extra"] == {"tag": "s1", "ints": (1, 2, 1)}

    # A later save of the same step (a fresh, healthy process) publishes a complete step 2 and
    # leaves the killed save's directory alone.
    caplog.clear()
    assert save_steps(root, [2]).last_saved_step == 2
    assert sorted(os.listdir(step_dir(root, 2))) == sorted([MARKER, MANIFEST, shard_name(0, 1), "rank-00000.index.json"])
    assert [p.name for p in root.iterdir() if p.name.startswith(".deleting.")] == []
    assert saving_dirs(root) == [(2, partial)]
    info = inspect_dir(2, step_dir(root, 2), verify=True)
    assert info.complete and info.verified, info.problem
    step, state = restore_fresh(root)
    assert step == 2 and model_equal(state["model"], tiny_model(2))
    assert find_latest(root, verify=True).step == 2
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    # The killed writer is gone. A copy it committed but never published is a second copy of the
    # complete step 2 now: the next start removed it (replace.finish). Any other, a prune that
    # asks removes, and nothing else (one killed before its note was written, or after it was
    # removed, once past the floor).
    if partial.exists() and not (partial / INPROGRESS).exists():
        old = time.time() - SAVE_DIR_FLOOR_S - 1
        for p in [partial, *partial.iterdir()]:
            os.utime(p, (old, old))
    done = execute(root, RetentionPolicy(keep=5, remove_incomplete_older_than=0, young_threshold=0))
    assert done.deleted == ([] if second_copy else [partial.name]) and saving_dirs(root) == []
    assert [i.step for i in list_checkpoints(root) if i.complete] == [2, 1]


def test_kill_in_a_fresh_process_via_environment(tmp_path: Path, traced_save: list[list[str]]) -> None:
    """The seam as documented: armed by the environment of a new process, read at import.
    Killed right before the marker rename: every other file of step 2 is durable already."""
    label = "rename.publish"
    root = tmp_path / "root"
    env = clean_env(SLURMRESUME_TEST_KILL_AT=f"{label}:{_nth(traced_save[0], label, 1)}")
    proc = run_python([HELPERS / "save_steps.py", root, 1, 2], env=env)
    check(proc, -signal.SIGKILL)
    assert proc.stdout.split() == ["saved", "1"]
    assert find_latest(root).step == 1
    assert not step_dir(root, 2).exists()
    [(_, partial)] = saving_dirs(root)
    assert sorted(os.listdir(partial)) == sorted([MARKER, MANIFEST, shard_name(0, 1), "rank-00000.index.json"])


def test_injected_io_error_fails_the_save_cleanly(tmp_path: Path, traced_save: list[list[str]]) -> None:
    """SLURMRESUME_TEST_FAIL_AT: an EIO in the shard fsync fails that save with SaveError (exit
    code != 0, one message naming the directory); the previous step stays the newest."""
    root = tmp_path / "root"
    env = clean_env(SLURMRESUME_TEST_FAIL_AT=f"fsync.shard:{_nth(traced_save[0], 'fsync.shard', 1)}")
    proc = run_python([HELPERS / "save_steps.py", root, 1, 2], env=env)
    assert proc.returncode == 1, proc.stderr
    assert "SaveError" in proc.stderr and f"{root}/.saving.step_000000002." in proc.stderr, proc.stderr
    assert "injected I/O error" in proc.stderr
    assert find_latest(root).step == 1
    # nothing of the failed save is left behind: its own directory is removed
    assert not step_dir(root, 2).exists() and saving_dirs(root) == []

"""A process SIGKILLed in the middle of its 2nd save (before the commit marker is renamed into
place): restore skips the partial directory, naming it in a warning, and loads the previous
complete checkpoint; saving that step again later replaces the partial directory.

The kills go through the test-only fault seam of slurmresume/checkpoint/fsio.py
(SLURMRESUME_TEST_KILL_AT="label:N"). The label list is checked against a trace of a real save
(SLURMRESUME_TEST_TRACE), so a new durability step without a crash test fails here."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest
from helpers.core import model_equal, restore_fresh, save_steps, step_dir, tiny_model
from helpers.procs import HELPERS, check, clean_env, run_python

from slurmresume.checkpoint.layout import INPROGRESS, MANIFEST, MARKER, shard_name
from slurmresume.checkpoint.store import find_latest, inspect_dir, list_checkpoints

# Every label a save crosses before (and including) the marker rename, in order.
KILL_LABELS = [
    "write.inprogress", "fsync.inprogress", "rename.inprogress", "fsyncdir.inprogress",
    "fsyncdir.root", "write.shard.header", "write.shard.data", "fsync.shard", "rename.shard",
    "fsyncdir.step", "write.manifest", "fsync.manifest", "rename.manifest", "fsyncdir.manifest",
    "write.marker", "fsync.marker", "rename.marker",
]
# (label, which crossing within the 2nd save): also the last data write of the tensor stream
# (the same as the first when the writer needs only one write for this small shard).
CASES: list[tuple[str, int | str]] = [(label, 1) for label in KILL_LABELS] + [("write.shard.data", "last")]


def _split_saves(trace: list[str]) -> list[list[str]]:
    saves: list[list[str]] = []
    for label in trace:
        if label == "write.inprogress":
            saves.append([])
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
    upto = first[: first.index("rename.marker") + 1]
    assert list(dict.fromkeys(upto)) == KILL_LABELS
    # and after the marker rename only clean-up / directory fsyncs remain
    assert set(first[first.index("rename.marker") + 1:]) <= {"fsyncdir.marker", "unlink.inprogress",
                                                             "fsyncdir.step", "fsyncdir.root"}


@pytest.fixture(scope="module")
def killed_roots(tmp_path_factory: pytest.TempPathFactory, traced_save: list[list[str]]) -> dict:
    """One root per case, each left behind by a process killed during its save of step 2.
    All kills run in one helper process that forks a child per case (imports torch once)."""
    tmp = tmp_path_factory.mktemp("kills")
    jobs = []
    for label, k in CASES:
        name = f"{label}-{k}"
        jobs.append({"root": str(tmp / name), "steps": [1, 2], "stdout": str(tmp / f"{name}.out"),
                     "env": {"SLURMRESUME_TEST_KILL_AT": f"{label}:{_nth(traced_save[0], label, k)}"}})
    (tmp / "jobs.json").write_text(json.dumps(jobs))
    proc = check(run_python([HELPERS / "kill_matrix.py", tmp / "jobs.json"], timeout=300))
    results = json.loads(proc.stdout)
    return {(label, k): r for (label, k), r in zip(CASES, results, strict=True)}


@pytest.mark.parametrize(("label", "k"), CASES, ids=[f"{lb}-{k}" for lb, k in CASES])
def test_kill_mid_save_falls_back_then_resave_replaces(
    killed_roots: dict, label: str, k: int | str, caplog: pytest.LogCaptureFixture
) -> None:
    r = killed_roots[(label, k)]
    root = Path(r["root"])
    assert r["signal"] == signal.SIGKILL, r
    assert "saved 1" in r["stdout"] and "saved 2" not in r["stdout"], r["stdout"]

    partial = step_dir(root, 2)
    assert partial.is_dir(), "the kill came before step_000000002/ existed?"
    assert not (partial / MARKER).exists()
    assert (partial / INPROGRESS).exists() or label.endswith("inprogress")
    infos = {i.step: i for i in list_checkpoints(root)}
    assert infos[1].complete and not infos[2].complete

    caplog.set_level(logging.WARNING, logger="slurmresume")
    step, state = restore_fresh(root)
    assert step == 1
    assert model_equal(state["model"], tiny_model(1))
    assert state["step"] == 1 and state["extra"] == {"tag": "s1", "ints": (1, 2, 1)}
    warned = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert any(str(partial) in m for m in warned), warned

    # A later save of the same step (a fresh, healthy process) replaces the partial directory.
    caplog.clear()
    assert save_steps(root, [2]).last_saved_step == 2
    assert sorted(os.listdir(partial)) == sorted([MARKER, MANIFEST, shard_name(0, 1)])
    assert [p.name for p in root.iterdir() if p.name.startswith(".deleting.")] == []
    info = inspect_dir(2, partial, verify=True)
    assert info.complete and info.verified, info.problem
    step, state = restore_fresh(root)
    assert step == 2 and model_equal(state["model"], tiny_model(2))
    assert find_latest(root, verify=True).step == 2
    assert not [rec for rec in caplog.records if rec.levelno >= logging.WARNING]


def test_kill_in_a_fresh_process_via_environment(tmp_path: Path, traced_save: list[list[str]]) -> None:
    """The seam as documented: armed by the environment of a new process, read at import.
    Killed right before the marker rename: every other file of step 2 is durable already."""
    label = "rename.marker"
    root = tmp_path / "root"
    env = clean_env(SLURMRESUME_TEST_KILL_AT=f"{label}:{_nth(traced_save[0], label, 1)}")
    proc = run_python([HELPERS / "save_steps.py", root, 1, 2], env=env)
    check(proc, -signal.SIGKILL)
    assert proc.stdout.split() == ["saved", "1"]
    assert find_latest(root).step == 1
    assert not (step_dir(root, 2) / MARKER).exists()
    assert (step_dir(root, 2) / MANIFEST).exists() and (step_dir(root, 2) / shard_name(0, 1)).exists()


def test_injected_io_error_fails_the_save_cleanly(tmp_path: Path, traced_save: list[list[str]]) -> None:
    """SLURMRESUME_TEST_FAIL_AT: an EIO in the shard fsync fails that save with SaveError (exit
    code != 0, one message naming the directory); the previous step stays the newest."""
    root = tmp_path / "root"
    env = clean_env(SLURMRESUME_TEST_FAIL_AT=f"fsync.shard:{_nth(traced_save[0], 'fsync.shard', 1)}")
    proc = run_python([HELPERS / "save_steps.py", root, 1, 2], env=env)
    assert proc.returncode == 1, proc.stderr
    assert "SaveError" in proc.stderr and str(step_dir(root, 2)) in proc.stderr, proc.stderr
    assert "injected I/O error" in proc.stderr
    assert find_latest(root).step == 1
    # nothing of the failed shard is left behind as a temp file
    assert [p.name for p in step_dir(root, 2).iterdir() if ".tmp." in p.name] == []

"""Hidden defaults must not end long runs (issue #12): no 60-minute --time, no requeue cap while a
run makes progress, --time not longer than --signal-lead refused, every default in --help; job
arrays and heterogeneous jobs refused with one line; the drill never deletes a user's files."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmresume.cli import app
from slurmresume.contract import Outcome
from slurmresume.errors import ConfigError
from slurmresume.job.config import JobSpec, requeue_cap_reached
from slurmresume.job.torchrun import RunResult, decide
from slurmresume.tools.drill import WORKDIR_MARK, prepare_workdir

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250", **(env or {})})


@pytest.mark.parametrize(("done", "cap", "reached"), [
    (0, None, False), (20, None, False), (10_000, None, False),  # default: no cap at all
    (0, 0, True), (4, 5, False), (5, 5, True), (6, 5, True),  # explicit --max-requeues N
])
def test_requeue_cap_applies_only_when_set(done: int, cap: int | None, reached: bool) -> None:
    assert requeue_cap_reached(done, cap) is reached


def test_a_progressing_run_is_requeued_past_twenty_by_default() -> None:
    """~20 h of hourly time limits used to end the job; with the default it goes on, and the
    no-progress guard still stops a run that commits nothing new."""
    moved = RunResult(0, Outcome("r", "preempt", 2100, True), 2000, 2100, warned=True)
    kw = dict(first_node=True, failures_done=0, max_failures=0)
    assert decide(moved, requeues_done=20, max_requeues=None, previous_progressed=True, **kw)[0] == "requeue"
    assert decide(moved, requeues_done=500, max_requeues=None, previous_progressed=True, **kw)[0] == "requeue"
    stuck = RunResult(0, Outcome("r", "preempt", 2000, True), 2000, 2000, warned=True)
    assert decide(stuck, requeues_done=3, max_requeues=None, previous_progressed=False, **kw)[0] == "give_up"
    assert decide(moved, requeues_done=5, max_requeues=5, previous_progressed=True, **kw)[0] == "give_up"


def test_no_time_given_means_no_time_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(tmp_path / "ck"), "--dry-run")
    assert res.exit_code == 0, res.output
    assert "#SBATCH --signal=USR1@120" in res.output
    assert "--time" not in res.output  # the partition's DefaultTime, neither 60 nor submitit's 5


def _fake_sbatch(bindir: Path, log: Path) -> dict:
    bindir.mkdir()
    script = bindir / "sbatch"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\necho 'Submitted batch job 4242'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return {"PATH": f"{bindir}:{os.environ['PATH']}"}


@pytest.mark.parametrize(("args", "message"), [
    (["--time", "2"], "not longer than --signal-lead"),
    (["--time", "2:00"], "not longer than --signal-lead"),
    (["--time", "10", "--signal-lead", "600"], "not longer than --signal-lead"),
    (["--sbatch", "array=0-3"], "array"),
    (["--sbatch", "--array=0-3"], "array"),
    (["--sbatch", "a=1-2"], "array"),
    (["--sbatch", "hetjob"], "heterogeneous"),
    (["--sbatch", "packjob"], "heterogeneous"),
    (["--sbatch", ":"], "heterogeneous"),
])
def test_refused_with_one_line_before_anything_is_written(tmp_path: Path, args: list[str], message: str) -> None:
    log = tmp_path / "sbatch.log"
    env = _fake_sbatch(tmp_path / "bin", log)
    res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(tmp_path / "ck"), *args, env=env)
    assert res.exit_code == 1, res.output
    assert message in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert "Traceback" not in res.output
    assert not log.exists() and not (tmp_path / "ck").exists()


def test_time_just_longer_than_the_lead_is_accepted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(tmp_path / "ck"), "--time", "3", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "#SBATCH --time=3" in res.output


@pytest.mark.parametrize("command", ["submit", "drill"])
def test_help_shows_every_default(command: str) -> None:
    res = invoke(command, "--help")
    assert res.exit_code == 0
    text = re.sub(r"[│╭╮╰╯─|+]", " ", res.output.split("Options", 1)[1])
    options = re.findall(r"^\s+(--[a-z-]+)", text, re.M)
    assert len(options) > 5
    # a plain flag is off unless given and shows no default (one style: test_cli_help_consistency)
    flags = {"--local", "--dry-run", "--json", "--help", "--discard-newer", "--takeover", "--no-script-check",
             "--shared-root"}
    blocks = re.split(r"\n\s+(?=--[a-z-]+\s)", text)
    for block in blocks:
        name = (block.split() or [""])[0]
        if name.startswith("--") and name not in flags:
            assert "default" in block, f"{command} {name}: no default shown in {block!r}"
    if command == "submit":
        assert "60" not in re.sub(r"\s+", " ", text).split("--time", 1)[1].split("--partition")[0]


# -- drill --workdir -------------------------------------------------------------------------


def test_drill_refuses_a_users_directory_and_keeps_its_files(tmp_path: Path) -> None:
    work = tmp_path / "mine"
    work.mkdir()
    (work / "thesis.tex").write_text("years of work")
    (work / "uninterrupted").mkdir()
    (work / "uninterrupted" / "notes.txt").write_text("also mine")
    res = invoke("drill", str(EXAMPLE), "--workdir", str(work), "--", "--steps", "4")
    assert res.exit_code == 1, res.output
    assert "not empty" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert (work / "thesis.tex").read_text() == "years of work"
    assert (work / "uninterrupted" / "notes.txt").read_text() == "also mine"
    assert not (work / WORKDIR_MARK).exists()


def test_drill_reuses_its_own_workdir_but_only_replaces_its_run_folders(tmp_path: Path) -> None:
    work = tmp_path / "drill"
    prepare_workdir(work)  # a fresh directory: created and marked
    assert (work / WORKDIR_MARK).is_file()
    (work / "preempted").mkdir()
    (work / "preempted" / "old").write_text("x")
    (work / "user.txt").write_text("keep me")
    prepare_workdir(work)  # a second drill in the same place
    assert not (work / "preempted").exists()
    assert (work / "user.txt").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_workdir(empty)
    assert (empty / WORKDIR_MARK).is_file()
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        prepare_workdir(afile)
    assert afile.read_text() == "x"


def test_an_unwarned_failure_carries_on_by_default(tmp_path: Path) -> None:
    """Issue 47: a run that failed without a warning (a rank SIGKILLed) resumes in the allocation
    by default, run after run while each commits a new step; two failed runs in a row without one
    stop the job; --max-failures 0 still means "do not retry"."""
    spec = JobSpec(script=EXAMPLE, ckpt_dir=tmp_path)
    assert spec.max_failures is None
    kw = dict(first_node=True, requeues_done=0, max_requeues=None, max_failures=spec.max_failures)
    killed = RunResult(1, None, 20, 37)  # the survivors' failure save committed step 37
    assert decide(killed, failures_done=50, previous_progressed=True, **kw)[0] == "retry"
    stuck = RunResult(1, None, 37, 37)
    assert decide(stuck, failures_done=51, previous_progressed=None, **kw)[0] == "retry"
    assert decide(stuck, failures_done=52, previous_progressed=False, **kw)[0] == "give_up"
    assert decide(killed, failures_done=0, previous_progressed=True, **{**kw, "max_failures": 0})[0] == "give_up"


@pytest.mark.parametrize(("node", "lost", "action"), [
    (0, (1,), "requeue"),  # the first node requeues
    (1, (2,), "stop"),  # another survivor leaves it to the first node
    (1, (0,), "requeue"),  # the first node is the one lost: every survivor requeues
])
def test_a_lost_node_requeues_the_job_instead_of_retrying_in_the_allocation(node: int, lost: tuple[int, ...],
                                                                             action: str) -> None:
    """Issue 47: a node whose launcher is gone (job/deathboard.py) cannot rendezvous again in this
    allocation: the job is requeued (a retry would wait at a rendezvous the lost node never joins),
    with the usual caps (no checkpoint, --max-requeues, the crash loop)."""
    kw = dict(requeues_done=0, max_requeues=None, failures_done=0, max_failures=None, previous_progressed=True)
    got, why = decide(RunResult(1, None, 20, 23, lost_nodes=lost), first_node=node == 0, **kw)
    assert got == action and f"node {lost[0]} lost" in why, why
    assert decide(RunResult(1, None, None, None, lost_nodes=(1,)), first_node=True, **kw)[0] == "give_up"
    assert decide(RunResult(1, None, 20, 23, lost_nodes=(1,)), first_node=True, **{**kw, "requeues_done": 3,
                                                                                     "max_requeues": 3})[0] == "give_up"

"""Issue #28: a drill that cannot lie. Besides the final checkpoints, the drill checks that every
restarted run resumed the step the previous run committed (and went on from the step after),
and that both runs passed the same `metrics=` at every step (bitwise).

Pure checks with tables; then the real drill (launcher + torchrun) on a script that never calls
restore() and on one that forgets its evaluation generator: both ended with bitwise-equal final
checkpoints and PASSed before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.procs import HELPERS

from slurmresume.tools.drillcheck import (
    RunFacts,
    first_metric_difference,
    partial_epoch_note,
    resumption_problems,
)
from slurmresume.train.steprecord import encode_metrics

SCRIPT = HELPERS / "train_drill_cases.py"


@pytest.mark.parametrize(("runs", "expect"), [
    ([RunFacts("a", None, 1, 8), RunFacts("b", 8, 9, 20), RunFacts("c", 20, 21, None)], []),
    ([RunFacts("a", None, 1, 8), RunFacts("b", None, 1, None)], ["run 2 (after the save at step 8) never restored"]),
    ([RunFacts("a", None, 1, 8), RunFacts("b", 5, 6, None)], ["run 2 restored step 5, but the run before it had committed step 8"]),
    ([RunFacts("a", None, 1, 8), RunFacts("b", 8, 1, None)], ["run 2 restored step 8 but its first ckpt.step() was step 1, not 9"]),
    ([RunFacts("a", None, 1, 24), RunFacts("b", 24, None, None)], []),  # warned at the last step: nothing left to run
    ([RunFacts("a", None, 1, None), RunFacts("b", None, 1, None)], []),  # nothing committed: judged elsewhere
])
def test_resumption_problems(runs: list[RunFacts], expect: list[str]) -> None:
    got = resumption_problems(runs)
    assert len(got) == len(expect)
    for line, start in zip(got, expect, strict=True):
        assert line.startswith(start), line
    if got and "never restored" in got[0]:
        assert "ckpt.restore(state)" in got[0]


GAN = [2, 4, 6, 8, 10, 12]  # Lightning's global_step with two optimizers: 2 per batch


@pytest.mark.parametrize(("runs", "framework", "expect"), [
    # issue #46: old code "run 2 restored step 4 but its first ckpt.step() was step 6, not 5"
    ([RunFacts("a", None, 2, 4), RunFacts("b", 4, 6, 8), RunFacts("c", 8, 10, None)], "lightning", []),
    # the restore event is there, but the Trainer started over: still a FAIL, with a Lightning fix
    ([RunFacts("a", None, 2, 4), RunFacts("b", 4, 2, None)], "lightning",
     ["run 2 restored step 4 but its first ckpt.step() was step 2, not 6: the Trainer did not go on"]),
    ([RunFacts("a", None, 2, 4), RunFacts("b", None, 2, None)], "lightning",
     ["run 2 (after the save at step 4) never restored a checkpoint and started over at step 2: pass SlurmResume()"]),
    ([RunFacts("a", None, 2, 4), RunFacts("b", 4, 6, None)], None,
     []),  # a script's own loop that counts by 2 (the uninterrupted run did too)
    ([RunFacts("a", None, 2, 8), RunFacts("b", 8, 9, None)], None,
     ["run 2 restored step 8 but its first ckpt.step() was step 9, not 10: continue counting"]),
    ([RunFacts("a", None, 1, 4), RunFacts("b", 4, 1, None)], "transformers",
     ["run 2 restored step 4 but its first ckpt.step() was step 1, not 6: the Trainer did not go on from the "
      "checkpoint: pass what resume.resume_from(trainer) returns"]),
])
def test_continuity_is_judged_in_the_steps_the_uninterrupted_run_counted(runs: list[RunFacts], framework: str | None,
                                                                         expect: list[str]) -> None:
    got = resumption_problems(runs, GAN, framework)
    assert len(got) == len(expect), got
    for line, start in zip(got, expect, strict=True):
        assert line.startswith(start), line
        assert "restore(" not in line or framework is None, line  # a Lightning/HF user calls no restore()


def _recs(*steps: tuple[int, dict], call: str = "step") -> list[dict]:
    return [{"run": "r", "step": s, "call": call, "metrics": encode_metrics(m)} for s, m in steps]


def test_the_first_differing_step_and_key_are_named() -> None:
    ref = {0: _recs((1, {"loss": 1.0}), (2, {"loss": 2.0, "val_loss": 0.5}), (3, {"loss": 3.0, "val_loss": 0.25}))}
    same = {0: _recs((1, {"loss": 1.0}), (2, {"loss": 2.0, "val_loss": 0.5}), (3, {"loss": 3.0, "val_loss": 0.25}))}
    assert first_metric_difference(ref, same) is None
    other = {0: _recs((1, {"loss": 1.0}), (2, {"loss": 2.0, "val_loss": 0.5}), (3, {"loss": 3.5, "val_loss": 0.3}))}
    d = first_metric_difference(ref, other)
    assert d is not None and (d.step, d.key, d.rank) == (3, "loss", 0)
    d = first_metric_difference(ref, other, ignore=("loss",))
    assert d is not None and (d.step, d.key) == (3, "val_loss")
    assert first_metric_difference(ref, other, ignore=("*loss",)) is None  # patterns, as for *_per_second


def test_floats_and_tensors_compare_bitwise() -> None:
    a = {0: _recs((1, {"x": 0.0, "t": torch.tensor([1.0, 2.0])}))}
    assert first_metric_difference(a, {0: _recs((1, {"x": 0.0, "t": torch.tensor([1.0, 2.0])}))}) is None
    assert first_metric_difference(a, {0: _recs((1, {"x": -0.0, "t": torch.tensor([1.0, 2.0])}))}) is not None
    nudged = torch.tensor([1.0, 2.0]).nextafter(torch.tensor(3.0))
    d = first_metric_difference(a, {0: _recs((1, {"x": 0.0, "t": nudged}))})
    assert d is not None and d.key == "t"


def test_a_replayed_step_must_repeat_itself_and_unmatched_steps_are_not_compared() -> None:
    ref = {0: _recs((1, {"loss": 1.0}), (2, {"loss": 2.0}))}
    replay = {0: _recs((1, {"loss": 1.0}), (2, {"loss": 2.0}), (2, {"loss": 2.5}), (3, {"loss": 9.0}))}
    d = first_metric_difference(ref, replay)
    assert d is not None and d.step == 2


def drill(tmp_path: Path, case: str, *opts: str) -> subprocess.CompletedProcess:
    """One warning (seed 3: at step 4 of 12): the first resumed run already shows either fault, so a
    second warning would only add a run."""
    return subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(SCRIPT), "--workdir", str(tmp_path / "w"),
                           "--preemptions", "1", "--seed", "3", "--ignore", "rng", *opts, "--", "--steps", "12",
                           "--case", case], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "COLUMNS": "400"})


def _fails(res: subprocess.CompletedProcess) -> list[str]:
    return [line for line in res.stdout.splitlines() if line.startswith("FAIL")]


@pytest.mark.slow
def test_a_script_that_never_restores_fails_the_drill(tmp_path: Path) -> None:
    """Old code: PASS (exit 0): each restart retrains from step 0 to the same final state."""
    res = drill(tmp_path, "no-restore")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    fails = _fails(res)
    assert fails and "never restored" in fails[0] and "ckpt.restore(state)" in fails[0], res.stdout
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.slow
def test_a_script_that_forgets_its_eval_generator_fails_naming_the_step(tmp_path: Path) -> None:
    """Old code: PASS: the final checkpoints are bitwise equal, only the val_loss stream differs.
    The first differing step is the first evaluation (every 3rd step) after the first resume."""
    res = drill(tmp_path, "eval-gen", "--json")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    verdict = json.loads(res.stdout[res.stdout.index("{"):])
    assert verdict["ok"] is False and verdict["differences"] == [] and verdict["resume_problems"] == []
    first_resume = min(verdict["saved_steps"])
    diff = verdict["metric_difference"]
    assert diff["key"] == "val_loss" and diff["step"] == (first_resume // 3 + 1) * 3, verdict


def test_a_partly_run_epochs_aggregate_is_left_out_where_marked_and_noted() -> None:
    """Issue #46: Lightning's train_loss_epoch after a mid-epoch resume covers only the batches
    the resumed process ran. Marked records leave it out (and the note says where); at every
    other step, and every other key, it is compared as before."""
    ref = {0: _recs((9, {"loss": 1.0, "loss_epoch": 0.5}), (10, {"loss": 2.0, "loss_epoch": 0.5}))}
    marked = _recs((9, {"loss": 1.0, "loss_epoch": 0.7}), (10, {"loss": 2.0, "loss_epoch": 0.7}))
    for rec in marked:
        rec["partial_epoch"] = ["loss_epoch"]
    assert first_metric_difference(ref, {0: marked}) is None
    assert partial_epoch_note({0: marked}).startswith("metric(s) 'loss_epoch' not compared at 2 step record(s) of "
                                                       "the preempted run (steps 9-10)")
    unmarked = _recs((9, {"loss": 1.0, "loss_epoch": 0.7}))
    d = first_metric_difference(ref, {0: unmarked})
    assert d is not None and d.key == "loss_epoch" and partial_epoch_note({0: unmarked}) == ""
    marked[0]["metrics"] = encode_metrics({"loss": 1.5, "loss_epoch": 0.7})  # a marked record still compares the rest
    d = first_metric_difference(ref, {0: marked})
    assert d is not None and (d.step, d.key) == (9, "loss")


def test_a_key_only_one_run_passed_is_not_compared() -> None:
    """Lightning hands over callback_metrics: the uninterrupted run still carries the last
    val_loss, a resumed process has none until its next validation."""
    ref = {0: _recs((5, {"loss": 1.0, "val_loss": 0.5}))}
    assert first_metric_difference(ref, {0: _recs((5, {"loss": 1.0}))}) is None


@pytest.mark.slow
def test_more_preemptions_than_steps_is_refused_in_one_line(tmp_path: Path) -> None:
    """Old code: silently planned 2 warnings for 3 steps and judged that."""
    res = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(SCRIPT), "--workdir", str(tmp_path / "w"),
                          "--preemptions", "3", "--", "--steps", "3", "--case", "unseeded"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "COLUMNS": "400"})
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if "--preemptions 3" in line]
    assert len(errors) == 1 and "at least 4 steps" in errors[0] and "ran 3" in errors[0], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and not (tmp_path / "w" / "preempted").exists()


@pytest.mark.slow
def test_ctrl_c_during_a_drill_is_interrupted_with_exit_130(tmp_path: Path) -> None:
    """Old code: the stopped run was judged ("1 of 3 warnings led to no save", exit 1)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "slurmresume", "drill", str(SCRIPT), "--workdir",
                             str(tmp_path / "w"), "--preemptions", "1", "--", "--steps", "400", "--case", "unseeded"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "COLUMNS": "400"})
    first = tmp_path / "w" / "uninterrupted" / "step_000000001"
    deadline = time.monotonic() + 300
    while not first.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # the drill's own process, as the terminal's Ctrl-C reaches it
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-2000:] + err[-3000:]
    assert "interrupted" in err and "FAIL" not in out and "PASS" not in out
    assert not (tmp_path / "w" / "preempted").exists()  # the second run never started


class _History:
    """A stateful object shaped like HF Trainer's saved trainer_state."""

    def __init__(self, runtime: float, loss: float) -> None:
        self.log = [{"step": 4, "eval_loss": loss, "eval_runtime": runtime, "eval_samples_per_second": 1 / runtime}]

    def state_dict(self) -> dict:
        return {"global_step": 4, "log_history": self.log}

    def load_state_dict(self, state: dict) -> None:
        self.log = state["log_history"]


def test_a_frameworks_timing_fields_in_its_log_history_are_not_compared(tmp_path: Path) -> None:
    """Old code: 'trainer_state ... non-tensor values differ' for any script with evaluation
    (HF Trainer's log_history carries eval_runtime and *_per_second)."""
    from slurmresume import Checkpointer
    from slurmresume.tools.compare import compare_checkpoints

    def save(root: Path, runtime: float, loss: float) -> Path:
        ck = Checkpointer(root, handle_signals=False)
        path = ck.save(4, {"trainer_state": _History(runtime, loss)})
        ck.close()
        assert path is not None
        return path

    a = save(tmp_path / "a", 0.25, 1.5)
    assert compare_checkpoints(a, save(tmp_path / "b", 0.75, 1.5), ("rng",)) == []
    diffs = compare_checkpoints(a, save(tmp_path / "c", 0.25, 1.25), ("rng",))
    assert [d.key for d in diffs] == ["trainer_state"]


def test_a_differing_value_inside_a_frameworks_state_is_named_by_its_path(tmp_path: Path) -> None:
    """Old code: "lightning state differs at 'lightning' (non-tensor values differ)", naming no
    callback or counter."""
    from slurmresume import Checkpointer
    from slurmresume.tools.compare import compare_checkpoints

    class Loops:
        def __init__(self, completed: int) -> None:
            self.completed = completed

        def state_dict(self) -> dict:
            return {"loops": {"fit_loop": {"epoch_progress": {"total": {"completed": self.completed}}}},
                    "callbacks": {"EarlyStopping": {"wait_count": 1}}}

        def load_state_dict(self, state: dict) -> None:
            pass

    def save(root: Path, completed: int) -> Path:
        ck = Checkpointer(root, handle_signals=False)
        path = ck.save(4, {"lightning": Loops(completed)})
        ck.close()
        assert path is not None
        return path

    diffs = compare_checkpoints(save(tmp_path / "a", 3), save(tmp_path / "b", 2), ("rng",))
    assert len(diffs) == 1 and diffs[0].detail.endswith("at loops/fit_loop/epoch_progress/total/completed: 3 vs 2"), diffs

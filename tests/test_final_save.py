"""Issue #13, item 5: saves that silently did nothing or were silently lost.

- a final `ckpt.save(step, state)` of a step a periodic save committed, after the state changed;
- an async save still in flight when the script ends without `close()`;
- a failed time-based save on several ranks stopping time-based saves for good;
- one rank + async + a seconds trigger writing every timed save twice."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from helpers.core import model_equal, tiny_model
from helpers.procs import HELPERS, check, clean_env, run_python, run_ranks

import slurmresume
from slurmresume import Checkpointer, SaveError
from slurmresume.checkpoint import commit as _commit
from slurmresume.checkpoint.layout import step_dirs
from slurmresume.contract import EXIT_SAVE_FAILED

RUN = HELPERS / "save_policy_run.py"


def committed(root: Path) -> list[tuple[int, str]]:
    path = root / "events.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [(e["step"], e["reason"]) for e in events if e["event"] == "save_committed"]


def _train(root: Path) -> tuple[Checkpointer, dict]:
    ck = Checkpointer(root, save_every=5, handle_signals=False)
    state = {"model": tiny_model(0), "best_val_loss": float("inf")}
    for step in range(1, 11):
        with torch.no_grad():
            state["model"][0].weight.add_(0.5)
        ck.step(step, state)
    return ck, state


def test_final_save_after_the_state_changed_replaces_the_periodic_one(tmp_path: Path) -> None:
    ck, state = _train(tmp_path)
    inode = (tmp_path / "step_000000010").stat().st_ino
    assert ck.save(10, state) is None  # unchanged since the periodic save: a no-op
    assert (tmp_path / "step_000000010").stat().st_ino == inode
    state["best_val_loss"] = 0.25  # the final evaluation
    with torch.no_grad():
        state["model"][2].bias.fill_(7.0)
    assert ck.save(10, state) == tmp_path / "step_000000010"
    ck.close()
    assert committed(tmp_path) == [(5, "periodic"), (10, "periodic"), (10, "explicit")]
    assert [s for s, _ in step_dirs(tmp_path)] == [10, 5]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".replacing.")]
    live = {"model": tiny_model(3), "best_val_loss": None}
    assert Checkpointer(tmp_path, handle_signals=False).restore(live) == 10
    assert live["best_val_loss"] == 0.25 and model_equal(live["model"], state["model"])


def test_a_failed_final_save_keeps_the_committed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replacement is written beside the committed step: a failure leaves the old one whole."""
    ck, state = _train(tmp_path)
    before = {"model": tiny_model(0)}
    before["model"].load_state_dict(state["model"].state_dict())
    state["best_val_loss"] = 0.25
    with torch.no_grad():
        state["model"][2].bias.fill_(7.0)

    def broken(*a, **k):  # type: ignore[no-untyped-def]
        raise OSError(5, "injected EIO")

    monkeypatch.setattr(_commit, "write_shard", broken)
    with pytest.raises(SaveError):
        ck.save(10, state)
    monkeypatch.undo()
    ck.close()
    live = {"model": tiny_model(3), "best_val_loss": None}
    assert Checkpointer(tmp_path, handle_signals=False).restore(live) == 10
    assert live["best_val_loss"] == float("inf") and model_equal(live["model"], before["model"])


@pytest.mark.slow
def test_async_save_in_flight_at_exit_is_finished(tmp_path: Path) -> None:
    proc = check(run_python([RUN, "exit-inflight", tmp_path], timeout=120))
    assert "script ends" in proc.stdout
    assert committed(tmp_path) == [(2, "periodic"), (4, "periodic")]
    assert (tmp_path / "step_000000004" / "COMMITTED").exists()


@pytest.mark.slow
def test_async_save_failing_at_exit_fails_the_process(tmp_path: Path) -> None:
    env = clean_env(SLURMRESUME_TEST_FAIL_AT="write.shard.header:2")  # the second save (step 4)
    proc = run_python([RUN, "exit-inflight", tmp_path], env=env, timeout=120)
    assert proc.returncode == EXIT_SAVE_FAILED, proc.stderr[-2000:]
    assert "the last async save failed and the script ended without ckpt.close()" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert committed(tmp_path) == [(2, "periodic")]


@pytest.mark.slow
def test_time_based_saves_go_on_after_a_failed_one_on_two_ranks(tmp_path: Path) -> None:
    env = clean_env(SLURMRESUME_TEST_FAIL_AT="write.shard.header:1")  # each rank's first save fails
    proc = run_ranks(2, RUN, "seconds-warn", tmp_path, env=env, timeout=300)  # forked ranks (helpers/forkranks.py)
    assert proc.returncode == 0, proc.stderr[-4000:]
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    failed = [e["step"] for e in events if e["event"] == "save_failed"]
    saved = [s for s, _ in committed(tmp_path)]
    assert len(failed) == 1 and len(saved) >= 2, (failed, saved)
    assert min(saved) > failed[0]


def test_one_rank_async_seconds_saves_each_step_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = _commit.commit

    def slow_commit(*a, **k):  # type: ignore[no-untyped-def]
        time.sleep(0.3)  # the write outlasts a step
        return real(*a, **k)

    monkeypatch.setattr(_commit, "commit", slow_commit)
    now = [0.0]
    ck = Checkpointer(tmp_path, save_policy=slurmresume.SavePolicy(every_seconds=10), async_save=True,
                      handle_signals=False)
    ck._sched.clock = lambda: now[0]
    ck._sched._started = ck._sched._last_save_end = 0.0
    state = {"w": torch.zeros(8)}
    stalls = []
    for step in range(1, 21):
        now[0] += 3.0
        state["w"] += 1
        time.sleep(0.12)  # the step's real work: four of them outlast one write
        t = time.perf_counter()
        ck.step(step, state)
        stalls.append(time.perf_counter() - t)
    ck.close()
    steps = [s for s, _ in committed(tmp_path)]
    # each timed save once, at least an interval (10 s = 4 steps of fake time) apart; how much
    # more depends on when the slowed write commits (the timer restarts at its end)
    assert steps[0] == 4 and len(steps) >= 2 and len(set(steps)) == len(steps), steps
    assert all(b - a >= 4 for a, b in zip(steps, steps[1:])), steps
    # training never waits for a write: only the snapshot steps cost anything (the first one
    # allocates the reused buffers)
    assert all(stall < 0.1 for step, stall in enumerate(stalls, 1) if step not in steps), stalls

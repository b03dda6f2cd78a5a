"""The step-boundary verdict (verdict.py): a table for the pure `judge`, and the small shell
(`StepBoundary`) on a world of one, where the agreement returns this rank's own value."""

from __future__ import annotations

import pytest

from slurmresume.checkpoint.collective import Group
from slurmresume.contract import EXIT_PREEMPTED, EXIT_SAVE_FAILED, EXIT_TERMINATED
from slurmresume.train.signals import NONE, PREEMPT, TERMINATE
from slurmresume.train.verdict import (
    StepBoundary,
    Verdict,
    drill_step_from_env,
    encode,
    exit_code,
    judge,
)


@pytest.mark.parametrize(("signal", "time_due", "trigger", "world", "expected"), [
    (NONE, False, None, 4, Verdict()),
    (NONE, False, "steps", 4, Verdict(save="steps")),
    (NONE, False, "epoch", 4, Verdict(save="epoch")),
    # with several ranks, rank 0's clock counts only once it came back through the MAX
    (NONE, False, "seconds", 4, Verdict()),
    (NONE, True, None, 4, Verdict(save="seconds")),
    (NONE, True, "seconds", 4, Verdict(save="seconds")),
    (NONE, True, "steps", 4, Verdict(save="steps")),
    # alone, the clock is rank 0's own
    (NONE, False, "seconds", 1, Verdict(save="seconds")),
    # a signal wins over any save the policy wants
    (PREEMPT, True, "steps", 4, Verdict(signal=PREEMPT)),
    (TERMINATE, False, "epoch", 1, Verdict(signal=TERMINATE)),
])
def test_judge(signal: int, time_due: bool, trigger: str | None, world: int, expected: Verdict) -> None:
    assert judge(encode(signal, time_due), trigger, world) == expected


def test_the_max_over_ranks_keeps_the_strongest_signal_and_any_time_due() -> None:
    agreed = max(encode(NONE, True), encode(TERMINATE, False), encode(PREEMPT, False))
    assert judge(agreed, None, 3) == Verdict(signal=PREEMPT)
    assert judge(max(encode(NONE, True), encode(NONE, False)), None, 2) == Verdict(save="seconds")
    assert Verdict(signal=PREEMPT).emergency and not Verdict(save="steps").emergency


class _Flag:
    def __init__(self) -> None:
        self.request = NONE


def test_step_boundary_alone_acts_on_its_own_flag_at_once() -> None:
    flag = _Flag()
    boundary = StepBoundary(Group(), flag, None)  # type: ignore[arg-type]
    assert boundary.decide(1, None) == Verdict()
    assert boundary.decide(2, "seconds") == Verdict(save="seconds")
    assert boundary.decide(3, "seconds") == Verdict(save="seconds")  # never stuck as "posted" alone
    flag.request = TERMINATE
    assert boundary.decide(4, "steps") == Verdict(signal=TERMINATE)
    boundary.drain()


def test_a_restored_run_injects_its_drill_warning_after_the_restored_step() -> None:
    boundary = StepBoundary(Group(), None, 5)
    boundary.restored(9)
    assert boundary.drill_at == 10
    boundary.restored(2)
    assert boundary.drill_at == 10


@pytest.mark.parametrize(("plan", "restart", "expected"), [
    ("", "0", None), ("12,30,41", "0", 12), ("12,30,41", "2", 41), ("12,30", "2", None), ("12, x,30", "1", 30),
])
def test_drill_step_from_env(monkeypatch: pytest.MonkeyPatch, plan: str, restart: str, expected: int | None) -> None:
    monkeypatch.setenv("SLURMRESUME_DRILL_AT", plan)
    monkeypatch.setenv("SLURMRESUME_RESTART_COUNT", restart)
    assert drill_step_from_env() == expected


@pytest.mark.parametrize(("signal", "failed", "launcher", "recorded", "code"), [
    (PREEMPT, True, True, True, EXIT_SAVE_FAILED),
    (TERMINATE, True, False, False, EXIT_SAVE_FAILED),
    (PREEMPT, False, True, True, 0),  # the outcome record says what happened
    (PREEMPT, False, True, False, EXIT_PREEMPTED),  # no record: the code must say it
    (TERMINATE, False, True, False, EXIT_TERMINATED),
    (PREEMPT, False, False, False, EXIT_PREEMPTED),  # run bare
    (TERMINATE, False, False, True, EXIT_TERMINATED),
])
def test_exit_code_after_the_emergency_save(signal: int, failed: bool, launcher: bool, recorded: bool,
                                            code: int) -> None:
    assert exit_code(signal, failed, launcher, recorded) == code

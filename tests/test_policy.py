"""SavePolicy / SaveScheduler with a fake clock, the Young/Daly numbers, the event-log estimate,
and the interval section of `status`."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from slurmresume.cli import render as _render
from slurmresume.errors import ConfigError
from slurmresume.events import append_event
from slurmresume.tools import status
from slurmresume.train.savepolicy import (
    Estimate,
    SavePolicy,
    SaveScheduler,
    estimate_from_events,
    expected_loss_fraction,
    interval_summary,
    loss_fractions,
    young_daly,
)


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def drive(policy: SavePolicy, steps: range, *, seconds_per_step: float = 0.0, epoch: int | None = None,
          clock: FakeClock | None = None) -> list[int]:
    """Run a training loop against the scheduler; return the steps it saved."""
    clock = clock or FakeClock()
    sched = SaveScheduler(policy, clock)
    out = []
    for k in steps:
        clock.t = k * seconds_per_step
        if sched.due(k, epoch_end=epoch is not None and k % epoch == 0):
            out.append(k)
            sched.saved(k, 0.5)
    return out


# -- SavePolicy -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"every_steps": 0}, "every_steps=...) must be a positive integer"),
    ({"every_steps": -5}, "every_steps"),
    ({"every_steps": True}, "every_steps"),
    ({"every_steps": 2.5}, "every_steps"),
    ({"every_seconds": 0}, "every_seconds=...) must be a positive number of seconds"),
    ({"every_seconds": math.nan}, "every_seconds"),
    ({"every_seconds": math.inf}, "every_seconds"),
    ({"every_seconds": "10m"}, "every_seconds"),
    ({"at_epoch_end": "yes"}, "at_epoch_end"),
    ({"interval": "sometimes"}, "'auto' or None, got 'sometimes'"),
    ({"interval": "auto", "every_seconds": 60}, "not both"),
    ({"min_seconds": 0}, "min_seconds"),
    ({"max_seconds": -1}, "max_seconds"),
    ({"min_seconds": 600, "max_seconds": 60}, "min_seconds (600) is more than max_seconds (60)"),
])
def test_policy_validation(kwargs, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        SavePolicy(**kwargs)


def test_policy_is_frozen_and_keyword_only():
    with pytest.raises(TypeError):
        SavePolicy(10)  # type: ignore[misc]
    p = SavePolicy(every_steps=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.every_steps = 5  # type: ignore[misc]
    assert SavePolicy() == SavePolicy(every_steps=None, every_seconds=None, at_epoch_end=False, interval=None)


# -- SaveScheduler ----------------------------------------------------------------------------

def test_saves_exactly_on_the_configured_steps():
    assert drive(SavePolicy(every_steps=5), range(1, 23)) == [5, 10, 15, 20]


def test_saves_every_t_seconds_since_the_last_save():
    # a step every 3 s, a save due once >= 10 s have passed since the previous save ended
    assert drive(SavePolicy(every_seconds=10), range(1, 21), seconds_per_step=3) == [4, 8, 12, 16, 20]


def test_the_timer_restarts_when_a_save_ends():
    clock = FakeClock()
    sched = SaveScheduler(SavePolicy(every_seconds=10), clock)
    clock.t = 10
    assert sched.due(1)
    clock.t = 14  # the save took 4 s
    sched.saved(1, 4.0)
    clock.t = 23.9
    assert not sched.due(2)
    clock.t = 24
    assert sched.due(2)


def test_saves_at_epoch_ends_only_when_asked():
    assert drive(SavePolicy(at_epoch_end=True), range(1, 30), epoch=7) == [7, 14, 21, 28]
    assert drive(SavePolicy(), range(1, 30), epoch=7) == []
    assert drive(SavePolicy(every_steps=100), range(1, 30), epoch=7) == []


def test_the_combination():
    # steps: multiples of 10; seconds: 20 s at 3 s a step; epochs: every 13 steps
    got = drive(SavePolicy(every_steps=10, every_seconds=20, at_epoch_end=True), range(1, 41),
                seconds_per_step=3, epoch=13)
    assert got == [7, 10, 13, 20, 26, 30, 37, 39, 40]


def test_trigger_names_the_reason():
    clock = FakeClock()
    sched = SaveScheduler(SavePolicy(every_steps=10, every_seconds=5, at_epoch_end=True), clock)
    assert [sched.trigger(10, epoch_end=True), sched.trigger(3, epoch_end=True), sched.trigger(4)] == [
        "steps", "epoch", None]
    clock.t = 5
    assert sched.trigger(4) == "seconds" and sched.due(4)


def test_a_saved_step_is_never_due_twice():
    clock = FakeClock()
    sched = SaveScheduler(SavePolicy(every_steps=5, every_seconds=1, at_epoch_end=True), clock)
    assert sched.due(10, epoch_end=True)
    sched.saved(10, 0.1)
    clock.t = 1e6
    assert not sched.due(10) and not sched.due(10, epoch_end=True)
    sched.restored(20)
    assert not sched.due(20, epoch_end=True) and sched.due(21)


def test_bad_save_times_are_not_measured():
    sched = SaveScheduler(SavePolicy(interval="auto"), FakeClock())
    sched.saved(1, math.nan)
    sched.saved(2, -1.0)
    assert sched.save_cost_s is None


# -- Young/Daly ------------------------------------------------------------------------------

@pytest.mark.parametrize("c,m", [(1.0, 1.0), (148.8, 3.1 * 3600), (6.3, 3.1 * 3600), (0.0, 100.0), (2.5, 1e7)])
def test_young_daly_is_the_formula(c, m):
    assert young_daly(c, m) == pytest.approx(math.sqrt(2 * c * m), rel=1e-12)


def test_young_daly_matches_the_published_anchors():
    # perf-facts: at Llama 3's rate (one every ~3.1 h), ~30 min for a 148.8 s save, ~6 min for 6.3 s
    assert young_daly(148.8, 3.1 * 3600) / 60 == pytest.approx(30, abs=2)
    assert young_daly(6.3, 3.1 * 3600) / 60 == pytest.approx(6, abs=0.5)


def test_expected_loss_is_the_formula():
    assert expected_loss_fraction(600, 6, 36000) == pytest.approx(6 / 600 + 600 / 72000)
    assert loss_fractions(600, 6, 36000) == pytest.approx((0.01, 600 / 72000))
    assert loss_fractions(600, 6, None) == (0.01, 0.0)


@given(st.floats(0.01, 1000), st.floats(1e4, 1e8), st.floats(0.1, 10))
def test_young_daly_minimises_the_expected_loss(c, m, k):
    t = young_daly(c, m)
    assert expected_loss_fraction(t, c, m) <= expected_loss_fraction(t * k, c, m) * (1 + 1e-12)


# -- auto -----------------------------------------------------------------------------------

AUTO = SavePolicy(interval="auto", min_seconds=60, max_seconds=3600)


def test_auto_starts_at_the_minimum_until_a_save_is_measured():
    sched = SaveScheduler(AUTO, FakeClock())
    assert sched.interval_s == 60


@pytest.mark.parametrize("cost,runtime,interruptions,expected", [
    (0.001, 1000, 1, 60),            # sqrt(2) s: clamped up
    (1000, 1e6, 1, 3600),            # 44721 s: clamped down
    (10, 7200, 2, math.sqrt(2 * 10 * 3600)),
])
def test_auto_interval_is_young_daly_within_bounds(cost, runtime, interruptions, expected):
    sched = SaveScheduler(AUTO, FakeClock(), history=Estimate(interruptions=interruptions, runtime_s=runtime))
    sched.saved(1, cost)
    assert sched.interval_s == pytest.approx(expected)


def test_auto_adapts_as_the_run_survives():
    # C = 10 s, 2 interruptions in 7200 s before this run: MTBF = (7200 + t) / 2 at time t,
    # so the save comes due when t >= sqrt(2 * 10 * (7200 + t) / 2), i.e. at t = 273.37 s
    clock = FakeClock()
    sched = SaveScheduler(AUTO, clock, history=Estimate(save_cost_s=10, interruptions=2, runtime_s=7200))
    clock.t = 273.3
    assert not sched.due(5)
    clock.t = 273.4
    assert sched.due(5)


def test_auto_uses_the_median_of_recent_saves():
    sched = SaveScheduler(AUTO, FakeClock(), history=Estimate(save_cost_s=500, interruptions=1, runtime_s=36000))
    assert sched.save_cost_s == 500
    for i, cost in enumerate([2.0, 300.0, 2.0, 2.0, 1.0]):
        sched.saved(i, cost)
    assert sched.save_cost_s == 2.0
    assert sched.interval_s == pytest.approx(math.sqrt(2 * 2.0 * 36000))


def test_auto_without_a_failure_grows_with_the_runtime():
    clock = FakeClock()
    sched = SaveScheduler(AUTO, clock)
    sched.saved(1, 1.0)
    assert sched.interval_s == 60  # runtime ~0: MTBF's lower bound is ~0
    clock.t = 1e5
    assert sched.interval_s == pytest.approx(math.sqrt(2 * 1.0 * 1e5))
    clock.t = 1e8
    assert sched.interval_s == 3600


@given(cost=st.floats(0, 1e5), runtime=st.floats(0, 1e9), n=st.integers(0, 1000),
       lo=st.floats(1, 1e4), span=st.floats(0, 1e5), elapsed=st.floats(0, 1e7))
def test_auto_never_leaves_its_bounds(cost, runtime, n, lo, span, elapsed):
    clock = FakeClock()
    policy = SavePolicy(interval="auto", min_seconds=lo, max_seconds=lo + span)
    sched = SaveScheduler(policy, clock, history=Estimate(save_cost_s=cost, interruptions=n, runtime_s=runtime))
    clock.t = elapsed
    assert lo <= sched.interval_s <= lo + span


# -- the event log ----------------------------------------------------------------------------

def ev(t, event, **fields):
    return {"time": t, "event": event, "host": "n1", "pid": 7, **fields}


def synthetic_log() -> list[dict]:
    """Four runs of one job: killed, failed, preempted with a warning, finished.
    Saves cost 2, 2, 4, 3, 2 s; 340 s of work for 390 steps; 202+200+106+200 s running."""
    return [
        ev(900, "submitted"),
        ev(1000, "started", run_id="j.0.0"), ev(1000.5, "started", run_id="j.0.0", node=1),
        ev(1100, "save_committed", step=100, seconds=2.0, reason="periodic", run_id="j.0.0", pid=11),
        ev(1202, "save_committed", step=200, seconds=2.0, reason="periodic", run_id="j.0.0", pid=11),
        # killed: no run_ended, no exit
        ev(1300, "started", run_id="j.0.1"), ev(1310, "restored", step=200, run_id="j.0.1", pid=12),
        ev(1414, "save_committed", step=300, seconds=4.0, reason="periodic", run_id="j.0.1", pid=12),
        ev(1500, "run_ended", run_id="j.0.1", outcome="failed", returncode=1), ev(1500, "failed", returncode=1),
        ev(1600, "started", run_id="j.0.2"), ev(1610, "restored", step=300, run_id="j.0.2", pid=13),
        ev(1700, "signal_agreed", step=390, kind="preempt", run_id="j.0.2", pid=13),
        ev(1703, "save_committed", step=390, seconds=3.0, reason="preempt", run_id="j.0.2", pid=13),
        ev(1704, "exit_after_save", step=390, kind="preempt", run_id="j.0.2", pid=13),
        ev(1705, "run_ended", run_id="j.0.2", outcome="preempted"), ev(1706, "requeued", restart=1),
        ev(2000, "started", run_id="j.1.0", restart=1), ev(2010, "restored", step=390, run_id="j.1.0", pid=14),
        ev(2062, "save_committed", step=490, seconds=2.0, reason="periodic", run_id="j.1.0", pid=14),
        ev(2200, "run_ended", run_id="j.1.0", outcome="finished"), ev(2200, "finished", step=490),
    ]


def test_estimate_from_a_synthetic_log():
    est = estimate_from_events(synthetic_log())
    assert est == Estimate(save_cost_s=2.0, step_s=pytest.approx(340 / 390), mtbf_s=pytest.approx(354.0),
                           interruptions=2, runtime_s=pytest.approx(708.0))


def test_estimate_counts_a_bare_checkpointer_killed_between_processes():
    log = [ev(0, "save_committed", step=10, seconds=1.0, pid=1), ev(60, "save_committed", step=20, seconds=1.0, pid=1),
           ev(100, "restored", step=20, pid=2), ev(161, "save_committed", step=30, seconds=1.0, pid=2),
           ev(162, "exit_after_save", step=30, pid=2),
           ev(200, "restored", step=30, pid=3), ev(250, "save_committed", step=40, seconds=1.0, pid=3)]
    est = estimate_from_events(log)
    assert (est.interruptions, est.runtime_s, est.mtbf_s) == (1, 60 + 62 + 50, 172)
    assert est.step_s == pytest.approx((59 + 60 + 49) / 30)


def test_estimate_of_an_empty_or_foreign_log():
    assert estimate_from_events([]) == Estimate()
    assert estimate_from_events([ev(1, "submitted"), ev(2, "something_else")]) == Estimate()


def test_a_failed_launcher_retry_reported_late_by_another_node():
    log = [ev(0, "started", run_id="j.0.0"), ev(0, "started", run_id="j.0.0", node=1),
           ev(50, "run_ended", run_id="j.0.0", outcome="failed"), ev(51, "started", run_id="j.0.1"),
           ev(52, "run_ended", run_id="j.0.0", outcome="failed", node=1),
           ev(100, "run_ended", run_id="j.0.1", outcome="finished")]
    est = estimate_from_events(log)
    assert est.interruptions == 1 and est.runtime_s == pytest.approx(52 + 49)


def test_interval_summary_observed_and_logged():
    s = interval_summary(synthetic_log())
    assert s.source == "observed" and s.current_s == pytest.approx(100.0)  # 1202 - 1100 - 2
    assert s.save_cost_s == 2.0 and s.saves == 5 and s.interruptions == 2
    assert s.failures_per_hour == pytest.approx(2 / (708 / 3600))
    assert s.young_daly_s == pytest.approx(math.sqrt(2 * 2 * 354)) and s.auto_s == 60  # clamped up
    assert s.steps_per_second == pytest.approx(390 / 340)
    assert s.expected_loss == pytest.approx({"interval_s": 100.0, "saves": 0.02, "failures": 100 / 708,
                                             "total": 0.02 + 100 / 708})
    logged = synthetic_log() + [ev(2300, "save_committed", step=500, seconds=2, interval_s=300.0, run_id="x")]
    assert interval_summary(logged).source == "logged" and interval_summary(logged).current_s == 300.0
    empty = interval_summary([])
    assert (empty.current_s, empty.auto_s, empty.expected_loss, empty.failures_per_hour) == (None, None, None, None)


# -- status ----------------------------------------------------------------------------------

INTERVAL_KEYS = {"current_s", "source", "auto_s", "young_daly_s", "min_s", "max_s", "save_cost_s", "saves",
                 "steps_per_second", "runtime_s", "interruptions", "failures_per_hour", "mtbf_s", "expected_loss"}


@pytest.fixture
def no_slurm(monkeypatch):
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)


def test_status_interval_section(tmp_path, no_slurm):
    for e in synthetic_log():
        append_event(tmp_path, e.pop("event"), **{k: v for k, v in e.items() if k not in ("host", "pid")})
    plain = status.compute_status(tmp_path).to_json()
    assert "interval" not in plain  # the existing schema is unchanged unless asked
    st = status.compute_status(tmp_path, with_interval=True)
    data = json.loads(json.dumps(st.to_json(), allow_nan=False))
    assert set(data) == set(plain) | {"interval"} and set(data["interval"]) == INTERVAL_KEYS
    assert data["interval"]["interruptions"] == 2 and data["interval"]["saves"] == 5
    assert all(k in status.__doc__ for k in INTERVAL_KEYS | {"interval"})
    out = io.StringIO()
    Console(file=out, width=120, color_system=None).print(_render.status_view(st))
    text = out.getvalue()
    assert "save interval: 1m 40s (observed)" in text and "2 unwarned interruption(s)" in text
    assert "expected time lost at 1m 40s" in text and "redoing work" in text

"""The save policy inside Checkpointer.step(), with a fake clock: saves land exactly where the
policy says, never twice for one step, and a warning signal still saves between them."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers.core import warn_self

import slurmresume


def saved_steps(root: Path) -> list[tuple[int, str]]:
    events = [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]
    return [(e["step"], e["reason"]) for e in events if e["event"] == "save_committed"]


def test_steps_seconds_epoch_and_signal(tmp_path: Path) -> None:
    now = [0.0]
    policy = slurmresume.SavePolicy(every_steps=5, every_seconds=10, at_epoch_end=True)
    ck = slurmresume.Checkpointer(tmp_path, save_policy=policy, exit_on_signal=False)
    ck._sched.clock = lambda: now[0]
    ck._sched._started = ck._sched._last_save_end = 0.0
    state = {"w": torch.zeros(3)}
    signalled = []
    for step in range(1, 21):
        now[0] += 3.0  # every step takes 3 s of (fake) wall time
        if step == 12:
            warn_self(ck)  # the warning, between two periodic saves
        signalled.append(ck.step(step, state, epoch_end=step == 7))
    ck.close()
    got = saved_steps(tmp_path)
    steps = [s for s, _ in got]
    assert len(steps) == len(set(steps))  # no step saved twice
    assert {5, 10, 15, 20} <= set(steps)  # every 5 steps
    assert 7 in steps  # the epoch end
    assert (12, "preempt") in got and signalled[11] is True  # the signal save, then training goes on
    # seconds: 3 s/step and a 10 s interval restarting at each save -> never more than 4 steps apart
    assert all(b - a <= 4 for a, b in zip([0, *steps], steps))
    assert 4 in steps  # 12 s after the start, before any other trigger


def test_save_every_and_policy_exclusive(tmp_path: Path) -> None:
    import pytest

    with pytest.raises(slurmresume.ConfigError, match="either save_every or save_policy"):
        slurmresume.Checkpointer(tmp_path, save_every=3, save_policy=slurmresume.SavePolicy(every_steps=3))

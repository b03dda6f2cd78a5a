"""The write path keeps learning from real saves (issue #32): `checkpoint.bandit` decides (pure,
tested with tables), `calibrate` keeps the belief in the cache; real saves through the
Checkpointer follow what they measure, and an emergency save never explores."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import slurmresume
from slurmresume.checkpoint import bandit, calibrate, writer

S = writer.STRATEGIES
NOW = 1_000_000.0


def _belief(speeds: dict[str, float], at: float = NOW, tickets: int = 0, src: str = bandit.PROBE) -> dict:
    return {"paths": {n: {"gbps": g, "at": at, "n": 0, "src": src} for n, g in speeds.items()}, "tickets": tickets}


def test_pick_takes_the_best_and_explores_one_save_in_eight() -> None:
    b = _belief({"direct": 1.0, "buffered": 0.5, "direct-par": 0.4})
    picks = [bandit.pick(b, NOW, emergency=False, ticket=t) for t in range(16)]
    assert [t for t, (_, explored) in enumerate(picks) if explored] == [7, 15]
    assert all(p == ("direct", False) for t, p in enumerate(picks) if t not in (7, 15))
    assert picks[7] == ("buffered", True)  # equally old: the faster of the others (the runner-up)
    for t in range(16):  # an emergency save, or one that holds no ticket, never explores
        assert bandit.pick(b, NOW, emergency=True, ticket=t) == ("direct", False)
    assert bandit.pick(b, NOW, emergency=False, ticket=None) == ("direct", False)


def test_exploration_goes_to_the_path_measured_longest_ago() -> None:
    b = _belief({"direct": 1.0, "buffered": 0.5, "direct-par": 0.4})
    b["paths"]["buffered"]["at"] = NOW - 10
    b["paths"]["direct-par"]["at"] = NOW - 100
    assert bandit.pick(b, NOW, emergency=False, ticket=7) == ("direct-par", True)


def test_update_is_an_ewma_and_a_probe_figure_is_replaced_by_the_first_real_save() -> None:
    b = _belief({"direct": 1.0, "buffered": 0.5})
    b = bandit.update(b, "buffered", 0.8, NOW + 1)
    assert b["paths"]["buffered"] == {"gbps": 0.8, "at": NOW + 1, "n": 1, "src": "save"}
    b = bandit.update(b, "buffered", 1.6, NOW + 2)
    assert b["paths"]["buffered"]["gbps"] == pytest.approx(1.2) and b["paths"]["buffered"]["n"] == 2
    assert bandit.best(b, NOW + 2) == "buffered"
    assert bandit.update(b, "direct", float("nan"), NOW) is b  # a nonsense measurement changes nothing


def test_old_measurements_age_out_of_the_choice_but_are_explored_first() -> None:
    b = _belief({"direct": 2.0, "buffered": 1.0})
    b["paths"]["direct"]["at"] = NOW - bandit.AGE_OUT_S - 1
    assert bandit.best(b, NOW) == "buffered"
    assert bandit.pick(b, NOW, emergency=False, ticket=7) == ("direct", True)
    b["paths"]["buffered"]["at"] = NOW - bandit.AGE_OUT_S - 1
    assert bandit.best(b, NOW) is None  # nothing fresh: the shell measures again
    assert "aged out" in bandit.describe(b, NOW)


def _simulate(b: dict, truth: dict[str, float], saves: int) -> tuple[list[str], dict]:
    """The shell's loop, pure: ticket, pick, the save's measured GB/s, update."""
    used = []
    for i in range(saves):
        ticket, b = bandit.take_ticket(b)
        path, _ = bandit.pick(b, NOW + i, emergency=False, ticket=ticket)
        used.append(path)
        b = bandit.update(b, path, truth[path], NOW + i)
    return used, b


def test_a_path_that_becomes_three_times_faster_is_adopted_within_ten_saves() -> None:
    """The runner-up of the probes (buffered) is now 3x the cached choice."""
    b = _belief({"direct": 1.0, "direct-par": 0.3, "buffered-wb": 0.35, "buffered": 0.45})
    used, b = _simulate(b, {"direct": 1.0, "direct-par": 0.3, "buffered-wb": 0.35, "buffered": 3.0}, 10)
    assert used[-1] == "buffered" and bandit.best(b, NOW + 10) == "buffered", used


def test_every_path_is_explored_in_turn_so_the_last_of_the_probes_is_found_too() -> None:
    """The path the probes ranked last (as buffered at 0.45x on 2026-12-04) is tried within
    (paths - 1) x EXPLORE_EVERY saves, and adopted when it is now the fastest."""
    b = _belief({"direct": 1.0, "direct-par": 0.6, "buffered-wb": 0.5, "buffered": 0.45})
    n = (len(S) - 1) * bandit.EXPLORE_EVERY
    used, b = _simulate(b, {"direct": 1.0, "direct-par": 0.6, "buffered-wb": 0.5, "buffered": 3.0}, n + 1)
    assert used[n - 1] == "buffered" and used[n] == "buffered" and bandit.best(b, NOW + n) == "buffered", used


@pytest.mark.parametrize("entry", [None, [], {"paths": {"warp": {"gbps": 1.0, "at": 1.0}}},
                                   {"paths": {"direct": {"gbps": "fast", "at": 1.0}}},
                                   {"strategy": "direct", "gbps": {"direct": 1.0}, "stale": True}])
def test_a_damaged_or_stale_entry_is_no_belief(entry: object) -> None:
    assert bandit.belief_of(entry, S) is None


def test_an_entry_from_before_the_bandit_becomes_a_belief_of_probes() -> None:
    old = {"strategy": "direct", "gbps": {"direct": 0.8, "buffered": 0.36}, "measured_at": NOW,
           "trial": {"contenders": ["direct"], "observed": {}}}
    b = bandit.belief_of(old, S)
    assert b is not None and bandit.best(b, NOW) == "direct" and b["paths"]["buffered"]["src"] == "probe"


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "cache" / "writer.json"
    monkeypatch.setenv(calibrate.CACHE_ENV, str(path))
    monkeypatch.delenv(calibrate.ENV, raising=False)
    monkeypatch.delenv("SLURMRESUME_NO_ODIRECT", raising=False)
    monkeypatch.setattr(calibrate, "_memo", {})
    monkeypatch.setattr(calibrate, "RECHECK_MIN_BYTES", 1 << 20)  # a 4 MiB state counts as large here
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    return path


def _forced_speeds(monkeypatch: pytest.MonkeyPatch, speeds: dict[str, float]) -> None:
    """The test seam: each real save reports the GB/s of `speeds` for the path it used."""
    real = calibrate.observe

    def observe(directory: str, strategy: str, nbytes: int, seconds: float) -> None:
        real(directory, strategy, nbytes, nbytes / (speeds[strategy] * 1e9))

    monkeypatch.setattr(calibrate, "observe", observe)


def _writers(root: Path) -> list[str]:
    events = [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]
    return [e["writer"] for e in events if e["event"] == "save_committed"]


def test_real_saves_adopt_a_path_that_became_three_times_faster(tmp_path: Path, cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache says what a calibration in a busy hour found (O_DIRECT 0.80 GB/s, buffered 0.36,
    as on 2026-12-04); today buffered writes run 3x faster than O_DIRECT. Within 10 real saves the
    choice moves to buffered, and every checkpoint verifies whichever path wrote it."""
    root = tmp_path / "root"
    root.mkdir()
    calibrate._write_cache(calibrate.fs_key(root), {"strategy": "direct", "measured_at": time.time(),
                                                    "gbps": {"direct": 0.8, "buffered": 0.36}})
    _forced_speeds(monkeypatch, {"direct": 0.8, "buffered": 2.4})
    state = {"w": torch.zeros(1 << 20)}
    with slurmresume.Checkpointer(root, handle_signals=False) as ck:
        for step in range(1, 11):
            state["w"] += 1
            ck.save(step, {"m": state})
    used = _writers(root)
    assert used[-1] == "buffered" and used[:7] == ["direct"] * 7, used
    assert calibrate.cached_choice(root)["strategy"] == "buffered"  # type: ignore[index]
    info = slurmresume.find_latest(root, verify=True)
    assert info is not None and info.step == 10 and info.verified is True


def test_an_emergency_save_never_explores_and_records_nothing(tmp_path: Path, cache: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    root.mkdir()
    key = calibrate.fs_key(root)
    belief = _belief({"direct": 1.0, "buffered": 0.9}, at=time.time(), tickets=bandit.EXPLORE_EVERY - 1)
    calibrate._write_cache(key, bandit.to_entry(belief, time.time(), key=key))
    _forced_speeds(monkeypatch, {"direct": 1.0, "buffered": 0.9})
    before = cache.read_bytes()
    state = {"w": torch.ones(1 << 20)}
    with slurmresume.Checkpointer(root, handle_signals=False) as ck:
        for step in (1, 2, 3):  # the next ticket would explore: emergency saves take the best anyway
            with calibrate.emergency():
                ck.save(step, {"m": state})
        assert _writers(root) == ["direct"] * 3
        assert cache.read_bytes() == before  # no ticket taken, nothing recorded
        ck.save(4, {"m": state})  # the positive control: a periodic save with that ticket explores
    assert _writers(root)[-1] == "buffered"
    assert json.loads(cache.read_text())[key]["paths"]["buffered"]["n"] == 1


def test_status_shows_the_belief(tmp_path: Path, cache: Path) -> None:
    from types import SimpleNamespace

    from slurmresume.cli.render import writer_line

    root = tmp_path / "root"
    root.mkdir()
    now = time.time()
    belief = bandit.update(_belief({"direct": 0.8, "buffered": 0.36}, at=now - 7200), "buffered", 2.0, now - 30)
    calibrate._write_cache(calibrate.fs_key(root), bandit.to_entry(belief, now))
    line = writer_line(SimpleNamespace(writer={"last_save": "buffered", **calibrate.cached_choice(root)}))  # type: ignore[arg-type, dict-item]
    assert line is not None
    assert line.plain.startswith("write path: last save buffered; belief here: *buffered 2.00 GB/s (30 s ago, 1 save(s)); "
                                 "direct 0.80 GB/s (2.0 h ago, probe); the large save 8 from now explores"), line.plain


def test_the_whole_save_explores_together_on_rank_0s_ticket(tmp_path: Path, cache: Path) -> None:
    """At scale a rank exploring alone would gate every save on its slower path: rank 0 takes one
    ticket per save (`save_ticket`, in the prepare) and every rank follows it (`agreed`), taking
    no ticket of its own."""
    root = tmp_path / "root"
    root.mkdir()
    key = calibrate.fs_key(root)
    now = time.time()
    calibrate._write_cache(key, bandit.to_entry(_belief({"direct": 1.0, "buffered": 0.9}, at=now, tickets=6), now))
    assert calibrate.save_ticket(root) is False  # ticket 6
    for _ in range(3):  # the other ranks of that save: the best, no ticket taken
        with calibrate.agreed(False):
            assert calibrate.choose(root, 1 << 30) == ("direct", "calibrated")
    assert calibrate.save_ticket(root) is True  # ticket 7: this save explores, on every rank
    for _ in range(3):
        with calibrate.agreed(True):
            assert calibrate.choose(root, 1 << 30) == ("buffered", "explore")
    assert json.loads(cache.read_text())[key]["tickets"] == 8
    with calibrate.emergency():
        assert calibrate.save_ticket(root) is False
    assert json.loads(cache.read_text())[key]["tickets"] == 8

"""The write paths (writer.STRATEGIES) and the calibration that chooses between them."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import slurmresume
from slurmresume.checkpoint import calibrate, writer


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache" / "writer.json"
    monkeypatch.setenv(calibrate.CACHE_ENV, str(cache))
    monkeypatch.delenv(calibrate.ENV, raising=False)
    monkeypatch.delenv("SLURMRESUME_NO_ODIRECT", raising=False)
    calibrate._memo.clear()
    return cache


_RANDOM = os.urandom(5 << 20)


def _chunks() -> list[bytes]:
    # odd sizes, one over every staging buffer size, empty pieces, a tail that is not 4 KiB aligned
    return [b"x" * 13, bytes(range(256)) * 300_000, b"", _RANDOM, b"tail"]


@pytest.mark.parametrize("strategy", writer.STRATEGIES)
def test_every_strategy_writes_the_same_bytes(tmp_path: Path, strategy: str) -> None:
    want = b"".join(_chunks())
    p = tmp_path / f"f-{strategy}"
    sink = writer.ShardSink(p, strategy=strategy)
    for c in _chunks():
        sink.feed(c)
    digest = sink.finish()
    assert p.read_bytes() == want
    import xxhash

    assert digest == xxhash.xxh3_64_hexdigest(want)


@pytest.mark.parametrize("strategy", writer.STRATEGIES)
def test_forced_strategy_saves_loadable_identical_shards(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         strategy: str) -> None:
    monkeypatch.setenv(calibrate.ENV, strategy)
    g = torch.Generator().manual_seed(0)
    state = {"big": torch.randn(11_000_001, generator=g), "bf16": torch.randn(3, 1001, generator=g).to(torch.bfloat16),
             "ints": torch.arange(7)}
    root = tmp_path / strategy
    slurmresume.Checkpointer(root, handle_signals=False).save(1, {"t": state})
    shard = root / "step_000000001" / "rank-00000-of-00001.safetensors"
    loaded = load_file(shard)
    assert all(torch.equal(loaded[f"t/{k}"], v) for k, v in state.items())
    info = slurmresume.find_latest(root, verify=True)
    assert info is not None and info.verified is True
    events = [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]
    saved = [e for e in events if e["event"] == "save_committed"][-1]
    assert saved["writer"] == strategy and saved["bytes"] == shard.stat().st_size


def test_all_strategies_produce_byte_identical_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = {"w": torch.randn(3_000_003, generator=torch.Generator().manual_seed(1))}
    digests = set()
    for strategy in writer.STRATEGIES:
        monkeypatch.setenv(calibrate.ENV, strategy)
        root = tmp_path / strategy
        slurmresume.Checkpointer(root, handle_signals=False).save(5, {"m": state})
        digests.add(hashlib.sha256((root / "step_000000005" / "rank-00000-of-00001.safetensors").read_bytes()).hexdigest())
    assert len(digests) == 1


def test_calibration_picks_the_fastest_and_caches_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     _own_cache: Path) -> None:
    monkeypatch.setenv(calibrate.PROBE_ENV, "2")
    fake = {"direct": 0.5, "direct-par": 0.4, "buffered-wb": 0.1, "buffered": 0.3}
    real = calibrate.time_probe

    def probe(strategy: str, path: Path, src: memoryview, nbytes: int) -> float:
        real(strategy, path, src, nbytes)  # the probe file is really written (and must be removed)
        return fake[strategy]

    monkeypatch.setattr(calibrate, "time_probe", probe)
    got = calibrate.choose(tmp_path, size_hint=1 << 30)
    assert got == ("buffered-wb", "calibrated")
    entry = next(iter(json.loads(_own_cache.read_text()).values()))
    assert entry["strategy"] == "buffered-wb" and set(entry["gbps"]) == set(writer.STRATEGIES)
    # paths over 2x the fastest after round one are not measured again
    assert {k: len(v) for k, v in entry["seconds"].items()} == {"buffered-wb": 2, "direct": 1, "direct-par": 1,
                                                                  "buffered": 1}
    assert not list(tmp_path.glob(".slurmresume-calibrate*"))  # probes removed
    # the cache answers the next process (memory cleared) without measuring again
    calibrate._memo.clear()
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("measured again"))
    assert calibrate.choose(tmp_path, size_hint=1 << 30) == ("buffered-wb", "calibrated")


def test_small_shards_and_emergency_saves_never_calibrate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: pytest.fail("calibrated"))
    assert calibrate.choose(tmp_path, size_hint=1 << 20) == (calibrate.DEFAULT, "default")
    with calibrate.emergency():
        assert calibrate.choose(tmp_path, size_hint=8 << 30) == (calibrate.DEFAULT, "default")


def test_forced_strategy_and_bad_values(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(calibrate.ENV, "buffered")
    assert calibrate.choose(tmp_path, 1 << 40) == ("buffered", "forced")
    monkeypatch.setenv(calibrate.ENV, "nonsense")
    assert calibrate.choose(tmp_path, 0) == (calibrate.DEFAULT, "default")
    monkeypatch.delenv(calibrate.ENV)
    monkeypatch.setenv("SLURMRESUME_NO_ODIRECT", "1")
    assert calibrate.choose(tmp_path, 0) == ("buffered", "forced")


def test_a_much_slower_save_marks_the_choice_stale(tmp_path: Path, _own_cache: Path) -> None:
    key = calibrate.fs_key(tmp_path)
    calibrate._write_cache(key, {"strategy": "direct", "gbps": {"direct": 2.0}, "measured_at": 0})
    assert calibrate.choose(tmp_path, 0) == ("direct", "calibrated")
    calibrate.observe(tmp_path, "direct", 1 << 30, 0.6)  # 1.8 GB/s: fine
    calibrate.observe(tmp_path, "direct", 1 << 30, 1.0)  # 1.07 GB/s: a slow hour, not a reason
    assert not json.loads(_own_cache.read_text())[key].get("stale")
    calibrate.observe(tmp_path, "direct", 1 << 30, 5.0)  # 0.2 GB/s: re-measure next time
    assert json.loads(_own_cache.read_text())[key]["stale"] is True
    assert calibrate.choose(tmp_path, 0) == (calibrate.DEFAULT, "default")  # small: not now
    assert calibrate.cached_choice(tmp_path)["stale"] is True  # type: ignore[index]
    # a calibration minutes old is not redone for one slow save
    calibrate._write_cache(key, {"strategy": "direct", "gbps": {"direct": 2.0}, "measured_at": time.time()})
    calibrate._memo.clear()
    calibrate.observe(tmp_path, "direct", 1 << 30, 5.0)
    assert not json.loads(_own_cache.read_text())[key].get("stale")


def test_real_calibration_on_this_disk(tmp_path: Path) -> None:
    entry = calibrate.calibrate(tmp_path, nbytes=4 << 20, rounds=1)
    assert entry["strategy"] in writer.STRATEGIES and all(g > 0 for g in entry["gbps"].values())
    assert not list(tmp_path.iterdir())


def test_early_writeback_unsupported_falls_back_to_plain_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes
    import errno

    def refuse(fd: int, offset: int, nbytes: int, flags: int) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(writer, "_sync_file_range", refuse)
    p = tmp_path / "f"
    sink = writer.ShardSink(p, strategy="buffered-wb")
    for c in _chunks():
        sink.feed(c)
    sink.finish()
    assert p.read_bytes() == b"".join(_chunks()) and sink.strategy == "buffered"


def _fake_probes(monkeypatch: pytest.MonkeyPatch, fake: dict[str, float]) -> None:
    monkeypatch.setenv(calibrate.PROBE_ENV, "2")
    real = calibrate.time_probe

    def probe(strategy: str, path: Path, src: memoryview, nbytes: int) -> float:
        real(strategy, path, src, nbytes)
        return fake[strategy]

    monkeypatch.setattr(calibrate, "time_probe", probe)


def test_a_near_tie_of_probes_is_settled_by_real_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         _own_cache: Path) -> None:
    """2026-12-04: the probes called direct 0.40 and buffered 0.38 GB/s and direct was kept, where
    buffered was 1.56x the best peer on a 4 GiB save. A near-tie now lets the next large saves
    decide: each contender once, then the best real GB/s; emergency saves never explore."""
    _fake_probes(monkeypatch, {"direct": 0.100, "direct-par": 0.5, "buffered-wb": 0.3, "buffered": 0.110})
    big = 1 << 30
    assert calibrate.choose(tmp_path, size_hint=big) == ("direct", "calibrated")  # the calibration's pick
    key = calibrate.fs_key(tmp_path)
    entry = json.loads(_own_cache.read_text())[key]
    assert entry["trial"] == {"contenders": ["direct", "buffered"], "observed": {}}  # within 1.25x only
    with calibrate.emergency():
        assert calibrate.choose(tmp_path, size_hint=big) == ("direct", "calibrated")
        calibrate.observe(tmp_path, "direct", big, 1.0)  # an emergency save records nothing
    assert calibrate.choose(tmp_path, size_hint=1 << 20) == ("direct", "calibrated")  # small shards: the pick
    assert calibrate.choose(tmp_path, size_hint=big) == ("direct", "calibrated")
    calibrate.observe(tmp_path, "direct", big, 4.0)  # 0.27 GB/s on a real save
    calibrate._memo.clear()  # another rank / the next process reads the trial from the cache
    assert calibrate.choose(tmp_path, size_hint=big) == ("buffered", "calibrated")
    assert calibrate.cached_choice(tmp_path)["trial"]["observed"] == {"direct": [0.268]}  # type: ignore[index]
    calibrate.observe(tmp_path, "buffered", big, 2.5)  # 0.43 GB/s: better on real saves
    entry = json.loads(_own_cache.read_text())[key]
    assert "trial" not in entry and entry["strategy"] == "buffered" and entry["settled_by"] == "saves"
    assert entry["settled"]["observed_gbps"] == {"direct": [0.268], "buffered": [0.429]}
    assert calibrate.choose(tmp_path, size_hint=big) == ("buffered", "calibrated")
    with calibrate.emergency():
        assert calibrate.choose(tmp_path, size_hint=big) == ("buffered", "calibrated")
    assert calibrate.cached_choice(tmp_path)["settled_by"] == "saves"  # type: ignore[index]


def test_a_clear_winner_of_the_probes_opens_no_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      _own_cache: Path) -> None:
    _fake_probes(monkeypatch, {"direct": 0.1, "direct-par": 0.2, "buffered-wb": 0.3, "buffered": 0.13})
    assert calibrate.choose(tmp_path, size_hint=1 << 30) == ("direct", "calibrated")
    entry = next(iter(json.loads(_own_cache.read_text()).values()))
    assert "trial" not in entry
    assert all(calibrate.choose(tmp_path, size_hint=1 << 30) == ("direct", "calibrated") for _ in range(3))


def test_trial_saves_write_real_checkpoints_with_each_contender(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                _own_cache: Path) -> None:
    """Through the Checkpointer: the saves of a trial use the contenders in turn (the event log's
    `writer`), every checkpoint verifies, and the trial then settles on one path."""
    key = calibrate.fs_key(tmp_path)
    calibrate._write_cache(key, {"strategy": "direct", "gbps": {"direct": 1.0, "buffered-wb": 0.9},
                                 "measured_at": time.time(),
                                 "trial": {"contenders": ["direct", "buffered-wb"], "observed": {}}})
    monkeypatch.setattr(calibrate, "RECHECK_MIN_BYTES", 1 << 20)  # a 4 MiB state counts as large here
    root = tmp_path / "root"
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    state = {"w": torch.zeros(1 << 20)}
    try:
        for step in (1, 2, 3):
            state["w"] += 1
            ck.save(step, {"m": state})
    finally:
        ck.close()
    events = [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]
    used = [e["writer"] for e in events if e["event"] == "save_committed"]
    settled = json.loads(_own_cache.read_text())[key]
    assert used[:2] == ["direct", "buffered-wb"] and used[2] == settled["strategy"], used
    assert "trial" not in settled and settled["settled_by"] == "saves"
    assert set(settled["settled"]["observed_gbps"]) == {"direct", "buffered-wb"}
    for step in (1, 2, 3):  # each checkpoint, whichever path wrote it, verifies with the step's bytes
        info = slurmresume.find_latest(root, verify=True, max_step=step)
        assert info is not None and info.step == step and info.verified is True


def test_status_line_shows_an_open_trial_and_how_the_path_was_settled() -> None:
    from types import SimpleNamespace

    from slurmresume.cli.render import writer_line

    base = {"last_save": "direct", "source": "calibrated", "strategy": "direct", "gbps": {"direct": 0.4}}
    open_ = writer_line(SimpleNamespace(writer={**base, "trial": {"contenders": ["direct", "buffered"],
                                                                 "observed": {"direct": [0.3]}}}))  # type: ignore[arg-type]
    assert open_ is not None and "settling by real saves: direct 1 save(s), buffered 0 save(s)" in open_.plain
    done = writer_line(SimpleNamespace(writer={**base, "settled_by": "saves"}))  # type: ignore[arg-type]
    assert done is not None and done.plain.endswith("settled by real saves")


@pytest.mark.parametrize("trial", [{"contenders": ["direct", "warp-drive"], "observed": {}},
                                   {"contenders": "direct", "observed": {}},
                                   {"contenders": ["direct", "buffered"], "observed": {"direct": ["fast"]}},
                                   ["direct"]])
def test_a_damaged_trial_in_the_cache_never_breaks_a_save(tmp_path: Path, _own_cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch, trial: object) -> None:
    """The cache is a file in the user's home: a damaged trial makes the entry no answer (a large
    save measures anew, a small one takes the default), and choose() still never raises."""
    key = calibrate.fs_key(tmp_path)
    calibrate._write_cache(key, {"strategy": "direct", "gbps": {"direct": 1.0}, "measured_at": time.time(),
                                 "trial": trial})
    assert calibrate.choose(tmp_path, size_hint=1 << 20) == (calibrate.DEFAULT, "default")
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: {"strategy": "buffered", "gbps": {"buffered": 1.0},
                                                                 "measured_at": time.time()})
    assert calibrate.choose(tmp_path, size_hint=1 << 30) == ("buffered", "calibrated")
    calibrate.observe(tmp_path, "buffered", 1 << 30, 1.0)  # and recording a save does not raise either

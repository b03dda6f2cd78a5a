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
    fake = {"direct": 0.5, "direct-par": 0.4, "buffered-wb": 0.1, "buffered": 0.3, "buffered-par": 0.35}
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
    assert {k: len(v) for k, v in entry["calibration"]["seconds"].items()} == {"buffered-wb": 2, "direct": 1, "direct-par": 1,
                                                                  "buffered": 1, "buffered-par": 1}
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


def test_a_much_slower_save_moves_the_choice_to_the_next_path(tmp_path: Path, _own_cache: Path) -> None:
    """A cache entry from before the bandit (probe speeds only) is a belief of probes: the first
    real save replaces its path's figure, and when that is far below the next path's, the next
    save takes that path (no stale mark, no re-measuring: issue #32)."""
    key = calibrate.fs_key(tmp_path)
    calibrate._write_cache(key, {"strategy": "direct", "gbps": {"direct": 2.0, "buffered": 1.0},
                                 "measured_at": time.time()})
    assert calibrate.choose(tmp_path, 0) == ("direct", "calibrated")
    calibrate.observe(tmp_path, "direct", 1 << 30, 1 / 1.8)  # 1.93 GB/s: still the best
    assert calibrate.choose(tmp_path, 1 << 30) == ("direct", "calibrated")
    calibrate.observe(tmp_path, "direct", 1 << 30, 10.0)  # 0.11 GB/s: the EWMA drops to ~1.02
    calibrate.observe(tmp_path, "direct", 1 << 30, 10.0)  # and to ~0.56, under buffered's 1.0
    assert calibrate.choose(tmp_path, 0) == ("buffered", "calibrated")
    with calibrate.emergency():
        assert calibrate.choose(tmp_path, 1 << 30) == ("buffered", "calibrated")
    assert calibrate.cached_choice(tmp_path)["belief"]["paths"]["direct"]["n"] == 3  # type: ignore[index]


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


def test_a_clear_winner_of_the_probes_opens_no_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      _own_cache: Path) -> None:
    _fake_probes(monkeypatch, {"direct": 0.1, "direct-par": 0.2, "buffered-wb": 0.3, "buffered": 0.13,
                                   "buffered-par": 0.14})
    assert calibrate.choose(tmp_path, size_hint=1 << 30) == ("direct", "calibrated")
    entry = next(iter(json.loads(_own_cache.read_text()).values()))
    assert "trial" not in entry
    assert all(calibrate.choose(tmp_path, size_hint=1 << 30) == ("direct", "calibrated") for _ in range(3))


@pytest.mark.parametrize("paths", [{"direct": {"gbps": "fast", "at": 1.0}}, ["direct"],
                                   {"warp-drive": {"gbps": 1.0, "at": 1.0}}, {"direct": {"gbps": float("inf"), "at": 1.0}},
                                   {"direct": {"gbps": 1.0}}])
def test_a_damaged_belief_in_the_cache_never_breaks_a_save(tmp_path: Path, _own_cache: Path,
                                                           monkeypatch: pytest.MonkeyPatch, paths: object) -> None:
    """The cache is a file in the user's home: a damaged belief makes the entry no answer (a large
    save measures anew, a small one takes the default), and choose() still never raises."""
    key = calibrate.fs_key(tmp_path)
    calibrate._write_cache(key, {"strategy": "direct", "tickets": 7, "paths": paths})
    assert calibrate.choose(tmp_path, size_hint=1 << 20) == (calibrate.DEFAULT, "default")
    monkeypatch.setattr(calibrate, "calibrate", lambda *a, **k: {"strategy": "buffered", "gbps": {"buffered": 1.0},
                                                                 "measured_at": time.time()})
    assert calibrate.choose(tmp_path, size_hint=1 << 30) == ("buffered", "calibrated")
    calibrate.observe(tmp_path, "buffered", 1 << 30, 1.0)  # and recording a save does not raise either
    assert calibrate.cached_choice(tmp_path)["belief"]["paths"]["buffered"]["n"] == 1  # type: ignore[index]


def test_writev_all_finishes_short_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffered writer hands many views to one writev; a short write (a signal, a pipe, a
    network file system) must resume mid-view, and empty views are skipped."""
    from slurmresume.checkpoint import fsio

    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, bufs: real(fd, [memoryview(b"".join(bytes(b) for b in bufs))[:7]]))
    views = [b"abc", b"", memoryview(bytes(range(256)) * 3), b"x" * 10, b"tail"]
    p = tmp_path / "f"
    fd = os.open(p, os.O_WRONLY | os.O_CREAT)
    try:
        fsio.writev_all(fd, views, "shard.data", p)
    finally:
        os.close(fd)
    assert p.read_bytes() == b"".join(bytes(v) for v in views)

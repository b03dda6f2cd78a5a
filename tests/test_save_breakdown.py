"""Every committed save records where its seconds went (issue #32): the shard write itself,
hashing, the fsync, the manifest and marker, the collectives; status prints it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import slurmresume
from slurmresume.checkpoint import calibrate, writer
from slurmresume.train.breakdown import describe, summarize


@pytest.mark.parametrize("strategy", writer.STRATEGIES)
def test_a_save_event_carries_its_breakdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    monkeypatch.setenv(calibrate.ENV, strategy)
    with slurmresume.Checkpointer(tmp_path, handle_signals=False) as ck:
        ck.save(1, {"m": {"w": torch.randn(3_000_000), "b": torch.randn(7)}})
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    saved = next(e for e in events if e["event"] == "save_committed")
    b = saved["breakdown"]
    assert set(b) >= {"prepare_s", "rank_write_s", "collective_s", "commit_s", "slowest_rank", "shard_s",
                      "shard_gbps", "write_calls_s", "hash_s", "fsync_s", "wait_s"}
    assert b["slowest_rank"] == 0 and b["hash_s"] > 0 and b["fsync_s"] > 0 and b["write_calls_s"] > 0
    assert b["shard_gbps"] == pytest.approx(saved["bytes"] / b["shard_s"] / 1e9, rel=0.01, abs=1e-3)
    # the parts fit inside each other: the shard's write inside the rank's, the phases inside the save
    assert b["fsync_s"] <= b["shard_s"] <= b["rank_write_s"]
    assert b["prepare_s"] + b["rank_write_s"] + b["collective_s"] + b["commit_s"] <= saved["seconds"]


def test_summarize_names_the_slowest_rank() -> None:
    def rep(rank: int, shard_s: float) -> SimpleNamespace:
        return SimpleNamespace(rank=rank, bytes=2_000_000_000,
                               timing={"shard_s": shard_s, "write_s": 0.5, "hash_s": 0.1, "fsync_s": 0.2, "wait_s": 0.0})

    failed = SimpleNamespace(rank=3, bytes=0, timing=None)
    b = summarize([rep(0, 1.0), rep(1, 2.0), rep(2, 1.5), failed], {"prepare": 0.01, "write": 1.1, "commit": 0.02,
                                                                    "collective": 1.0})
    assert b["slowest_rank"] == 1 and b["shard_gbps"] == 1.0 and b["rank_write_s"] == 1.1 and b["collective_s"] == 1.0
    assert describe(b) == ("shard 1.00 GB/s (2.00 s: write calls 0.50, hash 0.10, fsync 0.20, wait 0.00); "
                           "commit 0.02 s; collectives 1.00 s; prepare 0.01 s")
    assert summarize([failed], {"prepare": 0.5}) == {"prepare_s": 0.5}


def test_status_prints_the_newest_saves_breakdown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmresume.cli.render import writer_line
    from slurmresume.tools.status import compute_status

    monkeypatch.setenv(calibrate.ENV, "buffered")
    with slurmresume.Checkpointer(tmp_path, handle_signals=False) as ck:
        ck.save(1, {"w": torch.randn(1000)})
    line = writer_line(compute_status(tmp_path))
    assert line is not None and "that save: shard " in line.plain and "fsync" in line.plain, line

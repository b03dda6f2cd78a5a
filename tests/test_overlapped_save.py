"""The save's hashing runs on the writer's hasher thread, and the shard's fsync runs beside the
index file's write (issue #32), without changing a digest or the commit order: the marker is
fsynced only after every file it covers is."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import xxhash
from helpers.core import shard_rows

import slurmresume
from slurmresume.checkpoint import calibrate, hashing, writer
from slurmresume.checkpoint.layout import MANIFEST, MARKER


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"big": torch.randn(3_000_001, generator=g),  # several 4 MiB blocks, odd length
            "small": torch.randn(7, generator=g), "ints": torch.arange(5, dtype=torch.int64)}


def _recomputed(step_dir: Path) -> tuple[str, dict[str, list[str]]]:
    """The shard's xxh3 and each tensor's 4 MiB block digests, computed here from the file."""
    from safetensors import safe_open

    shard = next(step_dir.glob("rank-*.safetensors"))
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    blocks = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        data = raw[8 + n + a : 8 + n + b]
        blocks[name] = [xxhash.xxh3_64_hexdigest(data[i : i + (4 << 20)]) for i in range(0, len(data), 4 << 20)]
    with safe_open(str(shard), "pt"):  # a stock safetensors file
        pass
    return xxhash.xxh3_64_hexdigest(raw), blocks


@pytest.mark.parametrize("strategy", writer.STRATEGIES)
def test_the_writer_hashes_on_its_own_thread_and_the_digests_match_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    monkeypatch.setenv(calibrate.ENV, strategy)
    threads: list[int] = []

    class Recording:
        def __init__(self) -> None:
            self.inner = xxhash.xxh3_64()

        def update(self, data: Any) -> None:
            threads.append(threading.get_ident())
            self.inner.update(data)

        def hexdigest(self) -> str:
            return self.inner.hexdigest()

    def hexdigest(data: Any) -> str:
        threads.append(threading.get_ident())
        return xxhash.xxh3_64_hexdigest(data)

    monkeypatch.setattr(hashing, "xxhash", SimpleNamespace(xxh3_64=Recording, xxh3_64_hexdigest=hexdigest))
    state = _state()
    with slurmresume.Checkpointer(tmp_path, handle_signals=False) as ck:
        ck.save(1, {"m": state})
    main = threading.get_ident()
    assert len(threads) >= 4 and main not in threads, "the caller's thread hashed"
    step = tmp_path / "step_000000001"
    digest, blocks = _recomputed(step)
    manifest = json.loads((step / MANIFEST).read_text())
    (shard,) = shard_rows(manifest)
    assert shard["xxh3"] == digest
    index = json.loads((step / shard["index"]).read_text())["tensors"]
    assert {k: v["xxh3"] for k, v in index.items()} == blocks
    assert len(blocks["m/big"]) == 3
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    b = next(e for e in events if e["event"] == "save_committed")["breakdown"]
    assert b["hash_s"] > 0 and b["hash_wait_s"] >= 0
    assert slurmresume.find_latest(tmp_path, verify=True).step == 1
    loaded = {}
    slurmresume.Checkpointer(tmp_path, handle_signals=False).restore({"m": loaded})
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


@pytest.mark.parametrize("strategy", ["direct", "buffered"])
def test_the_index_is_written_during_the_shards_fsync_and_the_marker_is_fsynced_last(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    """Every fsync's file and interval, recorded at the os seam: the shard's fsync (made slow
    here) overlaps the index file's write and fsync, and the marker's fsync starts only after
    every other file's and directory's fsync of the save has returned."""
    monkeypatch.setenv(calibrate.ENV, strategy)
    real = os.fsync
    calls: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        start = time.monotonic()
        if ".safetensors.tmp" in path:
            time.sleep(0.4)
        real(fd)
        # only this save's files and directories: a thread an earlier test left in this worker
        # (a lease heartbeat) may fsync its own files meanwhile, through the same os.fsync
        if path == str(tmp_path) or "step_000000001" in path:
            with lock:
                calls.append((path, start, time.monotonic()))

    with slurmresume.Checkpointer(tmp_path, handle_signals=False) as ck:
        monkeypatch.setattr(os, "fsync", fsync)
        ck.save(1, {"m": _state()})
        monkeypatch.setattr(os, "fsync", real)
    (shard,) = [c for c in calls if ".safetensors.tmp" in c[0]]
    (index,) = [c for c in calls if ".index.json.tmp" in c[0]]
    (marker,) = [c for c in calls if Path(c[0]).name.startswith(f".{MARKER}.tmp")]
    (manifest,) = [c for c in calls if Path(c[0]).name.startswith(f".{MANIFEST}.tmp")]
    assert index[1] < shard[2], "the index's fsync waited for the shard's: no overlap"
    covered = [c for c in calls if c[1] < marker[1]]
    assert shard in covered and index in covered and manifest in covered
    late = [c for c in covered if c[2] > marker[1]]
    assert not late, f"the marker's fsync began before these ended: {late}"
    assert slurmresume.find_latest(tmp_path, verify=True).step == 1

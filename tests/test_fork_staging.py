"""Ranks forked after a save in their parent (fork-started workers, forked test ranks) must not
share the writer's staging buffers: Python's anonymous mmap is MAP_SHARED by default, so two
forked ranks writing through the direct paths filled one physical buffer and each committed
the other's bytes under its own checksum (found as an order-dependent failure of
test_guards: every shard of a 2-rank step failed its checksum)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest
import xxhash

from slurmresume.checkpoint import writer

SIZE = 48 << 20  # several staging buffers' worth


def _child(strategy: str, path: Path, fill: int, barrier: object, out: Path) -> None:
    data = bytes([fill]) * SIZE
    barrier.wait()  # type: ignore[attr-defined]
    sink = writer.ShardSink(path, strategy)
    sink.feed(memoryview(data))
    digest = sink.finish()
    ok = digest == xxhash.xxh3_64_hexdigest(data) and path.read_bytes() == data
    out.write_text("ok" if ok else "corrupt")


@pytest.mark.parametrize("strategy", ["direct", "direct-par"])
def test_ranks_forked_after_a_save_write_their_own_bytes(tmp_path: Path, strategy: str) -> None:
    first = writer.ShardSink(tmp_path / "parent", strategy)  # the parent's save: its staging buffers exist
    first.feed(memoryview(os.urandom(1 << 20)))
    first.finish()
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_child, args=(strategy, tmp_path / f"rank{i}", 0x10 + i, barrier,
                                              tmp_path / f"rank{i}.out")) for i in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [(tmp_path / f"rank{i}.out").read_text() for i in range(2)] == ["ok", "ok"]

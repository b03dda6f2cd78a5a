"""Where a save's seconds went, so that a slower save has a name (issue #32): the write of the
shard itself, hashing, the fsyncs, the manifest and marker, the collectives.

`Stopwatch` times the phases of `saving.save_collective` on each rank; `summarize` (pure) joins
rank 0's phases with every rank's write report (`ShardSink.timing`) into the `breakdown` of the
`save_committed` event, which `status`-style readers and `scripts/bench.py` print.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any


class Stopwatch:
    """Seconds per named phase (a phase entered twice adds up)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


def summarize(reports: Sequence[Any], phases: dict[str, float]) -> dict[str, Any]:
    """The breakdown of one save (pure). `reports`: every rank's WriteReport (bytes, timing);
    `phases`: rank 0's Stopwatch seconds (prepare, replica_digests, write, collective, commit).

      shard_gbps     bytes / seconds of the slowest rank's shard write (open to fsynced)
      shard_s        those seconds; `slowest_rank` which rank
      write_calls_s  its seconds inside write calls (thread-seconds)
      hash_s         its seconds hashing (xxh3 of the stream, per-block digests), on the
                     writer's hasher thread, beside the writes
      hash_wait_s    its caller waiting for that hasher (the rank's own thread hashes nothing)
      fsync_s        its final fsync
      wait_s         its caller waiting for the writer (the queue or a staging buffer)
      prepare_s, replica_digests_s, rank_write_s (rank 0's whole write, directory fsync
      included), collective_s (gathers and broadcasts, waiting for the slowest rank included),
      commit_s (manifest, marker, publish): rank 0's phases."""
    timed = [r for r in reports if getattr(r, "timing", None)]
    out: dict[str, Any] = {f"{'rank_write' if k == 'write' else k}_s": round(v, 4) for k, v in sorted(phases.items())}
    if not timed:
        return out
    slow = max(timed, key=lambda r: r.timing.get("shard_s", 0.0))
    t = slow.timing
    shard_s = float(t.get("shard_s") or 0.0)
    out.update({"slowest_rank": slow.rank, "shard_s": round(shard_s, 4),
                "shard_gbps": round(slow.bytes / shard_s / 1e9, 4) if shard_s > 0 else None,
                "write_calls_s": t.get("write_s"), "hash_s": t.get("hash_s"),
                "hash_wait_s": t.get("hash_wait_s"), "fsync_s": t.get("fsync_s"), "wait_s": t.get("wait_s")})
    return out


def describe(b: dict[str, Any]) -> str:
    """One line: `shard 1.52 GB/s (0.71 s: write calls 0.60, hash 0.10, fsync 0.20, wait 0.05);
    commit 0.01 s; collectives 0.00 s`."""
    def f(key: str) -> str:
        v = b.get(key)
        return "?" if not isinstance(v, (int, float)) else f"{v:.2f}"

    head = f"shard {f('shard_gbps')} GB/s ({f('shard_s')} s: write calls {f('write_calls_s')}, hash {f('hash_s')}, " \
           f"fsync {f('fsync_s')}, wait {f('wait_s')})"
    return f"{head}; commit {f('commit_s')} s; collectives {f('collective_s')} s; prepare {f('prepare_s')} s"

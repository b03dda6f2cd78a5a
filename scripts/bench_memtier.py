"""An in-allocation restore from the memory tier (issue 49: a snapshot on the node's tmpfs, in the
file format) against the same restore from the file tier, with the page cache dropped before
each, interleaved round by round (the order alternates) on the same state.

    python scripts/bench_memtier.py [--mib-per-rank 1024] [--rounds 5] [--dir DIR] [--memory-base /dev/shm]

One rank (the per-rank cost: every rank of a node reads its own shard at once). The restore is
what a restarted rank runs: `Checkpointer.restore` into the live state it has built (tensors
allocated once, as a restarted script's model is), every byte checked against its digest as it
is read in both tiers. The cache is dropped with /proc/sys/vm/drop_caches (as root), else with
POSIX_FADV_DONTNEED on the file tier's shards; tmpfs pages are the memory tier itself and stay.
`--dir` should be on the file system the checkpoints go to (the default is a temporary
directory, often on the same disk). Prints one JSON object: per-round seconds, medians, ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from slurmresume import Checkpointer
from slurmresume.checkpoint.collective import Group
from slurmresume.contract import ENV_MEMORY_DIR, ENV_SNAPSHOT_EVERY
from slurmresume.train.saving import payload_of, save_collective

TENSORS = 32  # a transformer-like state: a few dozen large tensors


def make_state(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4 // TENSORS)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(TENSORS)}


def drop_cache(root: Path) -> str:
    """How the cache was dropped: "drop_caches" (everything, as root) or "fadvise" (the shards)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in root.rglob("*.safetensors"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def restore(root: Path, memory: Path | None, state: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Seconds of one `Checkpointer.restore` and the tier it read (from the `restored` event)."""
    os.environ[ENV_MEMORY_DIR] = str(memory or "")
    os.environ[ENV_SNAPSHOT_EVERY] = "1" if memory else "off"
    ck = Checkpointer(root, handle_signals=False)
    t = time.perf_counter()
    step = ck.restore(state)
    dt = time.perf_counter() - t
    ck.close()
    assert step == 1, step
    last = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines() if '"restored"' in line][-1]
    return dt, str(last.get("tier", "file"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib-per-rank", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the file tier's root goes (default: a temporary directory)")
    ap.add_argument("--memory-base", default="/dev/shm")
    a = ap.parse_args()
    if a.rounds < 1 or a.mib_per_rank < 1:
        sys.exit("bench_memtier: --rounds and --mib-per-rank must be >= 1")
    base = Path(a.dir or tempfile.mkdtemp(prefix="bench-memtier-"))
    root, memory = base / "root", Path(tempfile.mkdtemp(prefix="bench-memtier-", dir=a.memory_base))
    try:
        state = make_state(a.mib_per_rank << 20, 1)
        for where in (root, memory):
            result = save_collective(Group(), where, 1, payload_of(1, state, None, None), replace_if_changed=False)
            assert result.outcome is not None and result.outcome.ok, result
        live = make_state(a.mib_per_rank << 20, 2)  # the restarted rank's state, built before restore
        times: dict[str, list[float]] = {"memory": [], "file": []}
        dropped = ""
        for tier_root in (memory, None):  # warm-up, not measured: the restore path's lazy imports
            restore(root, tier_root, live)
        for r in range(a.rounds):
            for tier in (("memory", "file") if r % 2 == 0 else ("file", "memory")):
                dropped = drop_cache(root)
                dt, got = restore(root, memory if tier == "memory" else None, live)
                assert got == tier, (tier, got)
                assert all(torch.equal(live[k], state[k]) for k in state)
                for t in live.values():
                    t.zero_()  # the next restore must write every byte again
                times[tier].append(round(dt, 4))
        med = {k: statistics.median(v) for k, v in times.items()}
        print(json.dumps({"bench": "memtier", "mib_per_rank": a.mib_per_rank, "rounds": a.rounds,
                          "file_root": str(root), "memory_root": str(memory), "cache": dropped,
                          "seconds": times, "median_s": med,
                          "file_over_memory": round(med["file"] / med["memory"], 2) if med["memory"] else None}))
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()

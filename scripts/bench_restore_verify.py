"""What verifying every byte on restore costs: the default restore (per-block xxh3 checked while
reading) against the same restore with the checks switched off, interleaved round by round on
the same checkpoint, warm (page cache) and cold (shard pages dropped with POSIX_FADV_DONTNEED).
Also the old way of verifying: a whole-shard checksum pass before loading (verify=True).

    python scripts/bench_restore_verify.py [--mib 256] [--rounds 5] [--dir /tmp/...]

Prints one JSON object: medians (seconds) and the median ratio verified / unverified.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from slurmresume import Checkpointer
from slurmresume.checkpoint import manifest as _manifest


def drop_cache(root: Path) -> None:
    for p in root.rglob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def restore(root: Path, state: dict, *, checks: bool, verify: bool = False) -> float:
    real = _manifest.Manifest.expected
    if not checks:
        _manifest.Manifest.expected = lambda self, rank: None  # type: ignore[method-assign]
    try:
        ck = Checkpointer(root, handle_signals=False)
        t = time.perf_counter()
        assert ck.restore(state, verify=verify) == 1
        dt = time.perf_counter() - t
        ck.close()
        return dt
    finally:
        _manifest.Manifest.expected = real  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    base = Path(a.dir or tempfile.mkdtemp(prefix="bench-verify-"))
    root = base / "ck"
    n = 8
    elems = a.mib * (1 << 20) // 4 // n
    state = {f"t{i}": torch.randn(elems) for i in range(n)}
    ck = Checkpointer(root, handle_signals=False)
    ck.save(1, state)
    ck.close()
    live = {k: torch.zeros_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {k: [] for k in ("warm_checked", "warm_unchecked", "cold_checked",
                                                     "cold_unchecked", "warm_verify_pass")}
    for r in range(a.rounds):  # interleaved, order alternating per round
        order = [True, False] if r % 2 == 0 else [False, True]
        for checks in order:
            times["warm_checked" if checks else "warm_unchecked"].append(restore(root, live, checks=checks))
        for checks in order:
            drop_cache(root)
            times["cold_checked" if checks else "cold_unchecked"].append(restore(root, live, checks=checks))
        times["warm_verify_pass"].append(restore(root, live, checks=False, verify=True))
    assert all(torch.equal(live[k], state[k]) for k in state)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratios = {
        "warm": statistics.median(c / u for c, u in zip(times["warm_checked"], times["warm_unchecked"])),
        "cold": statistics.median(c / u for c, u in zip(times["cold_checked"], times["cold_unchecked"])),
        "verify_pass_warm": statistics.median(v / u for v, u in zip(times["warm_verify_pass"], times["warm_unchecked"])),
    }
    print(json.dumps({"mib": a.mib, "rounds": a.rounds, "median_s": med, "median_ratio_checked_over_unchecked": ratios},
                      indent=1))


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Estimate the full suite's pytest time from tests/durations.json, without running it:

    python3 scripts/suite_estimate.py [--workers 4] [--short-s 0.4]

Collects what `bash scripts/test` would run (the exhaustive lane left out), prices each test by
its recorded seconds (a run's own contention is in them: they were recorded on this 2-core
machine with 4 workers) and a test not listed (under 3 s) at --short-s, then prints the Slurm
chains as tests/conftest.py builds them and the estimate: the Slurm lane (the tests that hold
the cluster alone, plus the longer chain's shared tests; their seconds should come from a
serial run, see scripts/durations.py), with the other tests on the other workers meanwhile and
on all of them after. An estimate, not a measurement: say so where it is quoted."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.suite_order import slurm_chains  # noqa: E402


def collected(marker: str | None = None) -> list[str]:
    args = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "--collect-only", "tests"]
    out = subprocess.run(args + (["-m", marker] if marker else []), cwd=REPO, capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "::" in line]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4, help="xdist workers (default: 4, as scripts/test)")
    ap.add_argument("--short-s", type=float, default=0.4, help="seconds for a test not listed (default: 0.4)")
    opts = ap.parse_args(argv)
    seconds = json.loads((REPO / "tests" / "durations.json").read_text())
    tests, slurm = collected(), collected("slurm")
    rest = [t for t in tests if t not in set(slurm)]
    listed = sum(seconds[t] for t in rest if t in seconds)
    short = sum(1 for t in rest if t not in seconds)
    total = listed + short * opts.short_s
    print(f"{len(rest)} tests beside Slurm's {len(slurm)}: {listed:.0f} s recorded, {short} unlisted x {opts.short_s} s")
    alone = set(collected("slurm and slurm_exclusive"))
    chains = slurm_chains(slurm, seconds, 2, alone)
    shared = [sum(seconds.get(t, 30.0) for t in chain if t not in alone) for chain in chains]
    for i, chain in enumerate(chains):
        print(f"slurm{i}: {sum(seconds.get(t, 30.0) for t in chain):.0f} s, {len(chain)} tests, "
              f"{shared[i]:.0f} s of them shared")
    # a test holding the cluster alone stops both chains: the lane is those plus the longer shared part
    lane = sum(seconds.get(t, 30.0) for t in alone) + max(shared)
    print(f"slurm lane: {lane:.0f} s")
    # the other tests have workers - 2 workers while the lane runs, then all of them
    free = opts.workers - len(chains)
    estimate = lane if total <= free * lane else lane + (total - free * lane) / opts.workers
    print(f"estimate: {estimate:.0f} s ({estimate / 60:.1f} min) on {opts.workers} workers")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

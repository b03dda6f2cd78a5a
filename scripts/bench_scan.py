#!/usr/bin/env python3
"""How long do `latest`, `status` and a prune plan take on a root with 10,000 step directories?

    python3 scripts/bench_scan.py [--steps 10000] [--complete-fraction 0.95] [--repeat 5]
                                  [--dir DIR] [--keep-dir] [--json-out FILE]

Builds a root of real checkpoints cheaply: one real save, then every other step directory gets
hard links to that shard and a manifest + marker rewritten for its step (so every marker
validates). A share of directories (1 - complete fraction) gets no marker, as killed saves leave.
Times, median of --repeat runs each:
  latest   store.find_latest        (newest-first, stops at the first complete)
  list     store.list_checkpoints   (every directory inspected: marker, manifest, sizes)
  status   status.compute_status    (newest 20 rows + event log, as the CLI; Slurm seam stubbed out)
  status --limit 0                  (every directory inspected)
  plan     retention.scan + plan_prune
warm (page cache hot) and cold (after `echo 3 > /proc/sys/vm/drop_caches`, root only; skipped
otherwise). Prints a table and then one JSON object. A benchmark, not a test.
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
from collections.abc import Callable
from pathlib import Path

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MANIFEST, MARKER, step_dir_name
from slurmresume.checkpoint.manifest import marker_bytes
from slurmresume.checkpoint.store import find_latest, list_checkpoints
from slurmresume.retention import RetentionPolicy, plan_prune, scan
from slurmresume.tools import status


def build(root: Path, steps: int, complete_fraction: float) -> dict[str, int]:
    """Step directories 1..steps; every k-th one (spread evenly) left without a marker."""
    import torch

    template = root / ".template"
    ck = Checkpointer(template, handle_signals=False)
    ck.save(0, {"w": torch.arange(4096, dtype=torch.float32)}, metrics={"loss": 1.0})
    src = template / step_dir_name(0)
    shard = next(src.glob("rank-*.safetensors"))
    manifest = json.loads((src / MANIFEST).read_bytes())
    incomplete_every = round(1 / (1 - complete_fraction)) if complete_fraction < 1 else 0
    counts = {"complete": 0, "incomplete": 0}
    for step in range(1, steps + 1):
        d = root / step_dir_name(step)
        d.mkdir()
        os.link(shard, d / shard.name)
        if incomplete_every and step % incomplete_every == 0:
            counts["incomplete"] += 1
            continue
        manifest.update(step=step, metrics={"loss": 1.0 / step})
        raw = json.dumps(manifest, separators=(",", ":")).encode()
        (d / MANIFEST).write_bytes(raw)
        (d / MARKER).write_bytes(marker_bytes(step, raw))
        counts["complete"] += 1
    shutil.rmtree(template)
    return counts


def drop_caches() -> bool:
    """Flush and drop the page cache, dentries and inodes (needs root)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def median_seconds(fn: Callable[[], object], repeat: int, cold: bool) -> float | None:
    runs = []
    for _ in range(repeat):
        if cold and not drop_caches():
            return None
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--complete-fraction", type=float, default=0.95)
    p.add_argument("--repeat", type=int, default=5, help="runs per measurement (median; >= 3)")
    p.add_argument("--dir", type=Path, default=None, help="where to build (default: a temp dir in /var/tmp)")
    p.add_argument("--keep-dir", action="store_true", help="do not delete the built root")
    p.add_argument("--json-out", type=Path, default=None)
    a = p.parse_args()
    if a.repeat < 3:
        p.error("--repeat must be >= 3")
    base = Path(tempfile.mkdtemp(prefix="bench_scan_", dir=a.dir or "/var/tmp"))
    root = base / "root"
    status.run_slurm = lambda args, timeout=10.0: None  # measure the filesystem, not squeue
    try:
        t0 = time.perf_counter()
        counts = build(root, a.steps, a.complete_fraction)
        build_s = time.perf_counter() - t0
        cases: dict[str, Callable[[], object]] = {
            "latest": lambda: find_latest(root, warn=False),
            "list": lambda: list_checkpoints(root),
            "status": lambda: status.compute_status(root, rows_limit=20),  # what `slurmresume status` does
            "status --limit 0": lambda: status.compute_status(root),
            "plan": lambda: plan_prune(scan(root), RetentionPolicy(keep=3), time.time()),
        }
        results = {}
        for name, fn in cases.items():
            fn()  # warm up
            warm = median_seconds(fn, a.repeat, cold=False)
            cold = median_seconds(fn, a.repeat, cold=True)
            results[name] = {"warm_s": warm, "cold_s": cold}
    finally:
        if not a.keep_dir:
            shutil.rmtree(base, ignore_errors=True)
    report = {"steps": a.steps, **counts, "repeat": a.repeat, "build_s": round(build_s, 3),
              "root": str(root), "results": results}
    print(f"{a.steps} step directories ({counts['complete']} complete, {counts['incomplete']} without marker), "
          f"median of {a.repeat}, built in {build_s:.1f} s under {base}")
    print(f"{'operation':<10} {'warm ms':>10} {'cold ms':>10}")
    for name, r in results.items():
        cold_txt = f"{r['cold_s'] * 1000:10.1f}" if r["cold_s"] is not None else f"{'n/a (root)':>10}"
        print(f"{name:<10} {r['warm_s'] * 1000:10.1f} {cold_txt}")
    print(json.dumps(report))
    if a.json_out:
        a.json_out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

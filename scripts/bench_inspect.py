#!/usr/bin/env python3
"""Time and peak memory of `slurmresume inspect --tensors` on a large checkpoint.

Builds one checkpoint of --gib GiB (default 1; 4 is the size the perf notes plan against)
from transformer-like tensors (64 MiB blocks, 2/3 float32, 1/3 bfloat16, one NaN), then runs,
interleaved and each in a fresh process:

    inspect           header + manifest only
    inspect --tensors the streamed min/max/mean/NaN/Inf pass
    naive load+stats  safetensors.torch.load_file, then torch stats per tensor (for contrast)

Peak memory is the growth of VmHWM over the process's RSS just before the call (reset with
/proc/self/clear_refs), so imports do not count. --cold drops the page cache before every
run (needs root). Prints a table and then one JSON object.

    python3 scripts/bench_inspect.py --gib 4 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BLOCK = 64 << 20

PROBE = r"""
import contextlib, io, json, sys, time
method, path = sys.argv[1], sys.argv[2]
import slurmresume.cli.commands_inspect, slurmresume.tools.inspect, torch, safetensors.torch  # imports do not count
from slurmresume.cli import app

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

with contextlib.redirect_stderr(io.StringIO()):
    app(["inspect", "/nonexistent/step_000000001"], standalone_mode=False)
before = kib("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
t0 = time.perf_counter()
if method == "naive":
    tensors = safetensors.torch.load_file(path + "/rank-00000-of-00001.safetensors")
    for t in tensors.values():
        x = t.float() if t.is_floating_point() else t.double()
        v = x[torch.isfinite(x)]
        v.min(), v.max(), v.double().mean(), torch.isnan(x).sum(), torch.isinf(x).sum()
else:
    args = ["inspect", path, "--json"] + (["--tensors"] if method == "tensors" else [])
    with contextlib.redirect_stdout(io.StringIO()):
        app(args, standalone_mode=False)
print(json.dumps({"seconds": time.perf_counter() - t0, "peak_growth_kib": kib("VmHWM") - before}))
"""

METHODS = {"header": "inspect", "tensors": "inspect --tensors", "naive": "naive load+stats"}


def build(root: Path, gib: float) -> Path:
    import torch

    from slurmresume import Checkpointer
    total = int(gib * (1 << 30))
    state: dict[str, torch.Tensor] = {}
    done = i = 0
    g = torch.Generator().manual_seed(0)
    while done < total:
        n = min(BLOCK, total - done)
        if i % 3 == 2:
            t = torch.randn(n // 2, generator=g).to(torch.bfloat16)
        else:
            t = torch.randn(n // 4, generator=g)
        state[f"layer{i:03d}"] = t
        done, i = done + n, i + 1
    state["layer000"][12345] = float("nan")
    t0 = time.perf_counter()
    Checkpointer(root, handle_signals=False).save(1, {"model": state})
    print(f"built {done / 2**30:.2f} GiB in {i} tensors, saved in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return root / "step_000000001"


def drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def warm_up(path: Path) -> None:
    """Read every file once, so that a warm run finds it in the page cache (a save may bypass it)."""
    for f in path.iterdir():
        with open(f, "rb", buffering=0) as fh:
            while fh.read(64 << 20):
                pass


def run_once(method: str, path: Path, cold: bool) -> dict:
    if cold and not drop_caches():
        raise SystemExit("--cold needs root (writes /proc/sys/vm/drop_caches)")
    if not cold:
        warm_up(path)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-c", PROBE, method, str(path)], capture_output=True, text=True,
                          env=env, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB (default 1)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per method, interleaved (default 3)")
    ap.add_argument("--dir", type=Path, default=None, help="where to build it (default: a temp dir)")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each run (root)")
    ap.add_argument("--no-naive", action="store_true", help="skip the load-everything baseline")
    args = ap.parse_args()
    if args.gib <= 0 or args.repeat < 1:
        raise SystemExit("--gib must be > 0 and --repeat >= 1")
    methods = [m for m in METHODS if not (args.no_naive and m == "naive")]
    base = Path(tempfile.mkdtemp(prefix="bench_inspect_", dir=args.dir))
    try:
        path = build(base, args.gib)
        size = sum(f.stat().st_size for f in path.iterdir())
        runs: dict[str, list[dict]] = {m: [] for m in methods}
        for _ in range(args.repeat):
            for m in methods:
                runs[m].append(run_once(m, path, args.cold))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    rows = []
    for m in methods:
        secs = statistics.median(r["seconds"] for r in runs[m])
        peak = max(r["peak_growth_kib"] for r in runs[m]) / 1024
        rows.append({"method": METHODS[m], "median_s": round(secs, 3), "gb_per_s": round(size / secs / 1e9, 2),
                     "peak_growth_mib": round(peak, 1), "peak_vs_size": round(peak * 2**20 / size, 4)})
    print(f"\ncheckpoint {size / 2**30:.2f} GiB, {args.repeat} run(s) each, "
          f"{'cold' if args.cold else 'warm'} page cache\n")
    print(f"| {'method':<18} | median s |   GB/s | peak RSS growth MiB | of size |")
    print(f"|{'-' * 20}|----------|--------|---------------------|---------|")
    for r in rows:
        print(f"| {r['method']:<18} | {r['median_s']:8.3f} | {r['gb_per_s']:6.2f} | {r['peak_growth_mib']:19.1f} "
              f"| {100 * r['peak_vs_size']:6.2f}% |")
    print(json.dumps({"bench": "inspect", "bytes": size, "repeat": args.repeat, "cold": args.cold,
                      "results": rows}, indent=2))


if __name__ == "__main__":
    main()

"""What the memory tier's snapshots cost a training step in steady state (issue 49):
examples/train.py on N ranks under torchrun, with $SLURMRESUME_MEMORY_DIR set (as the node
launcher sets it) and $SLURMRESUME_SNAPSHOT_EVERY 1, auto, or off, in interleaved rounds (the order
rotates), each run from a fresh checkpoint and memory root.

    python3 scripts/bench_snapcost.py [--rounds 5] [--nproc 2] [--arms 1,auto,off] -- [train.py args]

A run's figure is the median over ranks of each rank's median time between two `ckpt.step()`
calls (the first WARMUP steps left out); per round each arm against off, then the medians over
rounds with their spread (min-max). Each rank also reports what the training thread itself spent
in the tier (`MemoryTier.at_step`: the copy into the writer's buffers and the collective fit
check) and, for auto, the interval it printed. Default train.py args: --steps 300 --save-every 100000.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 10  # steps left out of the statistics (first steps: allocations, the first snapshots)
ARM_ENV = "BENCH_SNAPCOST_ARM"


def _child() -> None:
    import runpy

    from slurmresume.train import asyncsave, checkpointer, memtier

    gaps: list[float] = []
    tier_s: list[float] = []
    wait_s: list[float] = []  # of tier_s: waiting for the snapshot before (its background commit)
    write_s: list[float] = []  # a snapshot's commit on the writer thread
    last = [0.0]
    inside = [False]
    step, at_step = checkpointer.Checkpointer.step, memtier.MemoryTier.at_step
    wait, write = asyncsave.AsyncWriter.wait, memtier.MemoryTier._write
    checked, prepare = memtier.MemoryTier._checked, checkpointer.Checkpointer._prepare_payload
    check_s: list[float] = []  # of tier_s: the fit check (sizes, statvfs, meminfo, one MAX over ranks)
    prep_s: list[float] = []  # of tier_s: the payload (state_dict, skeleton, RNG)

    def timed_checked(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return checked(self, *args, **kwargs)
        finally:
            check_s.append(time.perf_counter() - t0)

    def timed_prepare(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return prepare(self, *args, **kwargs)
        finally:
            if inside[0]:
                prep_s.append(time.perf_counter() - t0)

    def timed_wait(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return wait(self, *args, **kwargs)
        finally:
            if inside[0]:
                wait_s[-1] += time.perf_counter() - t0

    def timed_write(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        try:
            return write(self, *args, **kwargs)
        finally:
            write_s.append(time.perf_counter() - t0)

    def timed_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        now = time.perf_counter()
        if last[0]:
            gaps.append(now - last[0])
        last[0] = now
        return step(self, *args, **kwargs)

    def timed_at_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        inside[0] = True
        wait_s.append(0.0)
        try:
            return at_step(self, *args, **kwargs)
        finally:
            inside[0] = False
            tier_s.append(time.perf_counter() - t0)

    checkpointer.Checkpointer.step = timed_step  # type: ignore[method-assign]
    memtier.MemoryTier.at_step = timed_at_step  # type: ignore[method-assign]
    asyncsave.AsyncWriter.wait = timed_wait  # type: ignore[method-assign]
    memtier.MemoryTier._write = timed_write  # type: ignore[method-assign]
    memtier.MemoryTier._checked = timed_checked  # type: ignore[method-assign]
    checkpointer.Checkpointer._prepare_payload = timed_prepare  # type: ignore[method-assign]
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "train.py"), run_name="__main__")
    finally:
        steady = gaps[WARMUP:] if len(gaps) > 2 * WARMUP else gaps
        def med(xs: list[float]) -> float:
            xs = xs[WARMUP:] if len(xs) > 2 * WARMUP else xs
            return statistics.median(xs) if xs else 0.0

        if steady:
            print("BENCH " + json.dumps({"rank": int(os.environ.get("RANK", "0")),
                                         "step_median_s": statistics.median(steady), "tier_median_s": med(tier_s),
                                         "wait_median_s": med(wait_s), "write_median_s": med(write_s),
                                         "check_median_s": med(check_s), "prepare_median_s": med(prep_s),
                                         "snapshots": len(write_s)}), flush=True)


def _run_once(arm: str, nproc: int, train_args: list[str]) -> tuple[list[dict], int | None]:
    from slurmresume.contract import ENV_MEMORY_DIR, ENV_SNAPSHOT_EVERY

    work = Path(tempfile.mkdtemp(prefix="bench-snapcost-"))
    memory = Path(tempfile.mkdtemp(prefix="bench-snapcost-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        env = {**os.environ, ARM_ENV: arm, ENV_MEMORY_DIR: str(memory), ENV_SNAPSHOT_EVERY: arm}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), *train_args, "--ckpt-dir", str(work / "ckpt")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"bench_snapcost: a run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        printed = re.findall(r"memory tier: a snapshot every (\d+) step", proc.stdout + proc.stderr)
        return ([json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("BENCH ")],
                int(printed[0]) if printed else None)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)


def _driver(argv: list[str]) -> None:
    import argparse

    sep = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description="step time with memory snapshots against without, interleaved rounds")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (default: 2)")
    p.add_argument("--arms", default="1,auto,off", help="snapshot_every values, comma-separated; off is required "
                   "(default: 1,auto,off)")
    args = p.parse_args(argv[:sep])
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if "off" not in arms or args.rounds < 1 or args.nproc < 1:
        sys.exit("bench_snapcost: --arms must include off; --rounds and --nproc must be >= 1")
    train_args = argv[sep + 1:] or ["--steps", "300", "--save-every", "100000"]
    rows: list[tuple[dict[str, float], dict[str, float], dict[str, int | None]]] = []
    for r in range(args.rounds):
        med: dict[str, float] = {}
        tier: dict[str, float] = {}
        waits: dict[str, float] = {}
        writes: dict[str, float] = {}
        checks: dict[str, float] = {}
        preps: dict[str, float] = {}
        chosen: dict[str, int | None] = {}
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotate which goes first
            recs, chosen[arm] = _run_once(arm, args.nproc, train_args)
            med[arm] = statistics.median(x["step_median_s"] for x in recs)
            tier[arm] = statistics.median(x["tier_median_s"] for x in recs)
            waits[arm] = statistics.median(x["wait_median_s"] for x in recs)
            writes[arm] = statistics.median(x["write_median_s"] for x in recs)
            checks[arm] = statistics.median(x["check_median_s"] for x in recs)
            preps[arm] = statistics.median(x["prepare_median_s"] for x in recs)
        rows.append((med, tier, chosen))
        print(f"round {r + 1}: " + ", ".join(
            f"{a} {med[a] * 1e3:.2f} ms" + ("" if a == "off" else f" ({100 * (med[a] / med['off'] - 1):+.2f} %, "
                                            f"training thread in the tier {tier[a] * 1e6:.0f} us, of which waiting "
                                            f"for the snapshot before {waits[a] * 1e6:.0f} us, the payload "
                                            f"{preps[a] * 1e6:.0f} us, the fit check {checks[a] * 1e6:.0f} us; "
                                            f"a snapshot's commit "
                                            f"{writes[a] * 1e6:.0f} us"
                                            + (f", auto chose {chosen[a]}" if a == "auto" else "") + ")")
            for a in arms), flush=True)

    def spread(xs: list[float], scale: float, fmt: str) -> str:
        return f"{format(statistics.median(xs) * scale, fmt)} ({format(min(xs) * scale, fmt)} .. {format(max(xs) * scale, fmt)})"

    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "nproc": args.nproc, "rounds": args.rounds,
               "train_args": train_args, "loadavg": os.getloadavg()}
    for arm in arms:
        line = f"{arm}: step median {spread([m[arm] for m, _, _ in rows], 1e3, '.2f')} ms"
        if arm != "off":
            line += (f", step / off - 1 = {spread([m[arm] / m['off'] - 1 for m, _, _ in rows], 100, '+.2f')} %, "
                     f"training thread in the tier {spread([t[arm] for _, t, _ in rows], 1e6, '.0f')} us")
        if arm == "auto":
            line += f", auto chose {[c[arm] for _, _, c in rows]}"
        print(f"over {len(rows)} rounds, median (min-max): {line}", flush=True)
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    if os.environ.get(ARM_ENV) and "RANK" in os.environ:
        _child()
    else:
        _driver(sys.argv[1:])

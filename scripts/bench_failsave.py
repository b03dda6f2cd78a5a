"""What the failure-time save costs a step in steady state (issue 47): examples/train.py, each rank
timing `FailureGuard.at_step` (the per-step snapshot: RNG states, skeleton, per-rank tensors,
published to the node-local directory) plus its optimizer pre-hook (the tail snapshot, published
the same way) against the time between two `ckpt.step()` calls.

    torchrun --standalone --nproc-per-node 3 scripts/bench_failsave.py --steps 300 --save-every 100000

Prints one line per rank: median and 90th percentile of the snapshot, the median step, the ratio.
The first step (the one-time replicated-set check, a collective) is reported apart.
"""

from __future__ import annotations

import os
import runpy
import statistics
import tempfile
import time
from pathlib import Path

from slurmresume.contract import ENV_HEARTBEAT_DIR
from slurmresume.train import checkpointer, failsave

if not os.environ.get(ENV_HEARTBEAT_DIR):  # as under the launcher: one node-local directory per run
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    shared = base / f"bench-failsave-{os.environ.get('TORCHELASTIC_RUN_ID', 'bare')}"
    shared.mkdir(exist_ok=True)
    os.environ[ENV_HEARTBEAT_DIR] = str(shared)

snap_s: list[float] = []
gaps: list[float] = []
last = [0.0]
tail = [0.0]  # the tail snapshot's time since the last boundary
at_step, step = failsave.FailureGuard.at_step, checkpointer.Checkpointer.step
pre_hook = failsave.FailureGuard._on_optimizer_step


def timed_at_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    try:
        return at_step(self, *args, **kwargs)
    finally:
        snap_s.append(time.perf_counter() - t0 + tail[0])
        tail[0] = 0.0


def timed_pre_hook(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    t0 = time.perf_counter()
    try:
        return pre_hook(self, *args, **kwargs)
    finally:
        tail[0] += time.perf_counter() - t0


def timed_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
    now = time.perf_counter()
    if last[0]:
        gaps.append(now - last[0])
    last[0] = now
    return step(self, *args, **kwargs)


failsave.FailureGuard.at_step = timed_at_step  # type: ignore[method-assign]
failsave.FailureGuard._on_optimizer_step = timed_pre_hook  # type: ignore[method-assign]
checkpointer.Checkpointer.step = timed_step  # type: ignore[method-assign]
try:
    runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "train.py"), run_name="__main__")
finally:
    if len(snap_s) > 2:
        rest = sorted(snap_s[1:])
        med, p90 = statistics.median(rest), rest[int(0.9 * (len(rest) - 1))]
        gap = statistics.median(gaps)
        print(f"rank {os.environ.get('RANK', '0')}: snapshot median {med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us, "
              f"mean {statistics.mean(rest) * 1e6:.0f} us (step mean {statistics.mean(gaps) * 1e3:.2f} ms), "
              f"first step {snap_s[0] * 1e3:.1f} ms; step median {gap * 1e3:.2f} ms; "
              f"snapshot / step = {100 * med / gap:.2f} %", flush=True)

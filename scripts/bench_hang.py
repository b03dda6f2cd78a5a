"""Hang figures (issue #14), in one command:

    PYTHONPATH=. python scripts/bench_hang.py [--hangs 2] [--steps 24] [--workdir /tmp/bench-hang]

Runs `slurmresume drill examples/train.py --hang N --nproc-per-node 2` (real launcher, torchrun,
gloo) and reads its event log for, per hang:
    detection latency  seconds from the hung rank's last heartbeat to the launcher's verdict
                       (the budget in force is printed beside it: latency = budget + poll delay)
    dump time          seconds to get every rank's stacks (faulthandler; py-spy when installed)
    kill -> resumed    seconds from the kill to the restarted run's first step() (start-up,
                       torch import, rendezvous, restore included)
and measures the heartbeat's cost per step in-process (one pwrite per ckpt.step()), as a share
of a 50 ms step. Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def heartbeat_cost(n: int = 50000) -> dict:
    from slurmresume.train.heartbeat import Beat

    with tempfile.TemporaryDirectory(dir="/dev/shm" if Path("/dev/shm").is_dir() else None) as d:
        beat = Beat(Path(d), 0)
        rounds = []
        for _ in range(5):
            t = time.perf_counter()
            for s in range(n):
                beat.beat_step(s)
            rounds.append((time.perf_counter() - t) / n)
        beat.close()
    per = statistics.median(rounds)
    return {"per_step_us": round(per * 1e6, 2), "share_of_50ms_step": f"{100 * per / 0.050:.4f}%"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hangs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-hang")
    args = ap.parse_args()
    cost = heartbeat_cost()
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(REPO / "examples" / "train.py"),
                           "--hang", str(args.hangs), "--nproc-per-node", "2", "--workdir", str(args.workdir),
                           "--json", "--", "--steps", str(args.steps), "--save-every", "4"],
                          capture_output=True, text=True)
    out = proc.stdout
    report = json.loads(out[out.index("{\n"):]) if "{\n" in out else {}
    hangs = (report.get("hangs") or {}).get("detected", [])
    resumed = [e for e in (report.get("hangs") or {}).get("resumed", []) if e.get("cause") == "hang"]
    rows = [{"rank": h["ranks"], "step": h["step"], "budget_s": h["budget_s"],
             "detection_latency_s": h["detect_latency_s"], "beyond_budget_s": h["beyond_budget_s"],
             "dump_s": h["dump_s"], "kill_to_first_resumed_step_s": r["seconds"] if r else None}
            for h, r in zip(hangs, resumed + [None] * len(hangs), strict=False)]
    print(json.dumps({"drill_ok": report.get("ok"), "drill_exit": proc.returncode,
                      "drill_wall_s": round(time.time() - started, 1), "hangs": rows, "heartbeat": cost,
                      "problems": (report.get("hangs") or {}).get("problems")}, indent=2))
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-3000:])
        raise SystemExit(1)


if __name__ == "__main__":
    main()

"""Where the seconds of a preemption go, phase by phase (warning -> agreement -> commit ->
requeue -> Slurm restarts the launcher -> torchrun + restore), on the real cluster
(`bash scripts/cluster.sh up` first). Usage: python scripts/bench_requeue.py [N]

Submits tests/helpers/sig_train.py (2 ranks), sends `scancel --signal=USR1` N times (default 3),
and reads the times from the event log. Prints a table and JSON; medians over the N preemptions.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "helpers" / "sig_train.py"


def events(root: Path) -> list[dict]:
    p = root / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def wait(pred, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise SystemExit("timed out")


# Each phase ends at the first event of its kind after the previous phase's end (per preemption).
PHASES = (
    ("warning -> ranks agree on a step", "signal_agreed", None),
    ("agreed -> commit marker durable (the save)", "save_committed", "preempt"),
    ("commit -> scontrol requeue", "requeued", None),
    ("requeue -> launcher started (Slurm)", "started", None),
    ("launcher started -> restored (torchrun, imports, restore)", "restored", None),
)


def phases(ev: list[dict], sent: list[float]) -> dict[str, list[float]]:
    """Seconds of each phase of each preemption, from the event log's times."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    out["warning -> training resumed (total)"] = []
    for t0 in sent:
        t = t0
        for name, event, reason in PHASES:
            nxt = next((e["time"] for e in ev if e["event"] == event and e["time"] >= t
                        and (reason is None or e.get("reason") == reason)), None)
            if nxt is None:
                break
            out[name].append(nxt - t)
            t = nxt
        else:
            out["warning -> training resumed (total)"].append(t - t0)
    return out


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    root = Path(tempfile.mkdtemp(prefix="bench-requeue-")) / "run"
    out = subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(SCRIPT), "--ckpt-dir", str(root),
                          "--nproc-per-node", "2", "--cpus-per-task", "2", "--time", "15", "--json", "--",
                          str(40 * (n + 1)), "0.1", "0"], capture_output=True, text=True, check=True)
    job = json.loads(out.stdout)["job_id"]
    sent: list[float] = []
    for k in range(n):
        wait(lambda k=k: sum(e["event"] == "restored" for e in events(root)) >= k
             and (root / "pids" / "progress0").exists()
             and int((root / "pids" / "progress0").read_text() or 0) >= 5 + 30 * k)
        sent.append(time.time())
        subprocess.run(["scancel", "--signal=USR1", job], check=True)
        wait(lambda k=k: sum(e["event"] == "restored" for e in events(root)) >= k + 1)
    ev = events(root)
    rows = phases(ev, sent)
    print(f"job {job}, {n} preemptions, 2 gloo ranks, medians (min-max) in seconds")
    for name, vals in rows.items():
        if vals:
            print(f"  {name:58s} {statistics.median(vals):7.2f}  ({min(vals):.2f}-{max(vals):.2f})")
    print(json.dumps({k: [round(v, 3) for v in vals] for k, vals in rows.items()}))
    subprocess.run(["scancel", job])


if __name__ == "__main__":
    main()

"""Where the seconds of a preemption go, phase by phase (warning -> agreement -> commit ->
requeue -> Slurm restarts the launcher -> torchrun -> the ranks' imports, process group, restore
-> the first resumed step), on the real cluster (`bash scripts/cluster.sh up` first).

    python scripts/bench_requeue.py [N]           # real Slurm: scancel --signal=USR1, N times (default 3)
    python scripts/bench_requeue.py [N] --local   # `submit --local`: the same launcher restarts torchrun
    python scripts/bench_requeue.py [N] --example # examples/train.py instead of the test helper
    python scripts/bench_requeue.py [N] --bytecode  # slurmresume's bytecode compiled first, as a wheel install has it
    python scripts/bench_requeue.py [N] --tree DIR  # the code of another checkout (a worktree), for before/after

Without --bytecode the tree's __pycache__ directories are removed first: in this sandbox
(PYTHONDONTWRITEBYTECODE=1, an editable install) every process then compiles the slurmresume
modules it imports, as it does here by default; a `pip install` of the wheel compiles them once.

Submits tests/helpers/sig_train.py (2 gloo ranks; with --example, examples/train.py with a
0.1 s sleep per step and a save every 20 steps, signalled once its current run has saved) and reads the times from the event log: the
coarse rows of earlier runs (kept, so that before/after compare), then the launcher's start-up
split finer from the fields the events carry (`started.launcher_started_at`: the launcher
process's start from /proc; `restored`: rank 0's process start, end of imports, Checkpointer
creation, restore; `resumed` (cause requeue): the first step after the restore, from the
heartbeat). Prints a table and JSON; medians (min-max) over the N preemptions.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "helpers" / "sig_train.py"
EXAMPLE = REPO / "examples" / "train.py"


def events(root: Path) -> list[dict]:
    p = root / "events.jsonl"
    out = []
    for line in (p.read_text().splitlines() if p.exists() else []):
        try:
            out.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return out


def wait(pred, timeout: float = 300) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise SystemExit("timed out")


# The coarse phases (as measured before 2026-12-03 evening): each ends at the first event of its
# kind after the previous phase's end (per preemption).
PHASES = (
    ("warning -> ranks agree on a step", "signal_agreed", None),
    ("agreed -> commit marker durable (the save)", "save_committed", "preempt"),
    ("commit -> scontrol requeue", "requeued", None),
    ("requeue -> launcher started (Slurm)", "started", None),
    ("launcher started -> restored (torchrun, imports, restore)", "restored", None),
)
TOTAL = "warning -> training resumed (total, to restored)"
# The finer split, from the fields of the `started`, `restored` and `resumed` events.
FINE = (
    "requeue -> launcher process start (Slurm: requeue, schedule, batch script, srun)",
    "launcher process start -> torchrun exec (python, launcher imports, start-up)",
    "torchrun exec -> rank 0 process start (torchrun: python, import torch, rendezvous)",
    "rank 0 start -> script imports done (python, import torch)",
    "imports -> Checkpointer created (process group init, model)",
    "Checkpointer created -> restore begins (side groups, lease)",
    "restore (collective: choose, load, verify)",
    "restored -> first resumed step done",
    "launcher process start -> first resumed step (goal <= 5 s)",
    "torchrun exec -> first resumed step",
    "warning -> first resumed step (total)",
)


def first_after(ev: list[dict], t: float, event: str, reason: str | None = None, **match: Any) -> dict | None:
    return next((e for e in ev if e["event"] == event and e["time"] >= t
                 and (reason is None or e.get("reason") == reason)
                 and all(e.get(k) == v for k, v in match.items())), None)


def phases(ev: list[dict], sent: list[float]) -> dict[str, list[float]]:
    """Seconds of each phase of each preemption, from the event log's times."""
    out: dict[str, list[float]] = {name: [] for name, _, _ in PHASES}
    out[TOTAL] = []
    out.update({name: [] for name in FINE})
    for t0 in sent:
        t = t0
        found: dict[str, dict] = {}
        for name, event, reason in PHASES:
            e = first_after(ev, t, event, reason)
            if e is None:
                break
            found[event] = e
            out[name].append(e["time"] - t)
            t = e["time"]
        else:
            out[TOTAL].append(t - t0)
        if "restored" not in found:
            continue
        req, st, rs = found["requeued"], found["started"], found["restored"]
        resumed = first_after(ev, st["time"], "resumed", cause="requeue")
        first = resumed["first_step_at"] if resumed and "first_step_at" in resumed else None
        launcher = st.get("launcher_started_at") if not st.get("local") else None
        marks = [
            (FINE[0], req["time"], launcher),
            (FINE[1], launcher, st["time"]),
            (FINE[2], st["time"], rs.get("process_started_at")),
            (FINE[3], rs.get("process_started_at"), rs.get("imported_at")),
            (FINE[4], rs.get("imported_at"), rs.get("created_at")),
            (FINE[5], rs.get("created_at"), rs.get("restore_began_at")),
            (FINE[6], rs.get("restore_began_at"), rs["time"]),
            (FINE[7], rs["time"], first),
            (FINE[8], launcher, first),
            (FINE[9], st["time"], first),
            (FINE[10], t0, first),
        ]
        for name, a, b in marks:
            if a is not None and b is not None:
                out[name].append(b - a)
    return out


def run_has_saved(root: Path, k: int) -> bool:
    """Run k (0 = the first) has started and committed a periodic save: it is training."""
    ev = events(root)
    starts = [e["time"] for e in ev if e["event"] == "started"]
    return len(starts) > k and any(e["event"] == "save_committed" and e["time"] > starts[k] for e in ev)


def run_slurm(n: int, root: Path, example: bool = False, tree: Path = REPO) -> tuple[str, list[float]]:
    script_args = (["--steps", "100000", "--step-sleep", "0.1", "--save-every", "20"] if example
                   else [str(40 * (n + 1)), "0.1", "0"])
    script = tree / ("examples/train.py" if example else "tests/helpers/sig_train.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-m", "slurmresume", "submit", str(script),
                          "--ckpt-dir", str(root), "--nproc-per-node", "2", "--cpus-per-task", "2", "--time", "15",
                          "--json", "--", *script_args], capture_output=True, text=True, check=True, env=env,
                         cwd=tree)  # the job's working directory comes first on its sys.path (`python -m`)
    job = json.loads(out.stdout)["job_id"]
    sent: list[float] = []
    try:
        for k in range(n):
            wait(lambda k=k: run_has_saved(root, k) if example else (
                sum(e["event"] == "restored" for e in events(root)) >= k
                and (root / "pids" / "progress0").exists()
                and int((root / "pids" / "progress0").read_text() or 0) >= 5 + 30 * k))
            sent.append(time.time())
            subprocess.run(["scancel", "--signal=USR1", job], check=True)
            wait(lambda k=k: sum(e["event"] == "resumed" and e.get("cause") == "requeue"
                                 for e in events(root)) >= k + 1)
    finally:
        subprocess.run(["scancel", job])
    return f"job {job}", sent


def run_local(n: int, root: Path) -> tuple[str, list[float]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PIDDIR"] = str(root.parent / "pids")
    log = open(root.parent / "launcher.log", "w")  # noqa: SIM115 - kept open for the launcher's life
    proc = subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", "--local", str(SCRIPT), "--ckpt-dir",
                             str(root), "--nproc-per-node", "2", "--", str(40 * (n + 1)), "0.1", "0"],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    progress = root.parent / "pids" / "progress0"
    sent: list[float] = []
    try:
        for k in range(n):
            wait(lambda k=k: sum(e["event"] == "restored" for e in events(root)) >= k and progress.exists()
                 and int(progress.read_text() or 0) >= 5 + 30 * k)
            sent.append(time.time())
            os.kill(proc.pid, signal.SIGUSR1)  # what Slurm does under proctrack/cgroup: the launcher only
            wait(lambda k=k: sum(e["event"] == "resumed" and e.get("cause") == "requeue"
                                 for e in events(root)) >= k + 1)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return f"local launcher pid {proc.pid}", sent


def main() -> None:
    args = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--") and sys.argv[i - 1] != "--tree"]
    local = "--local" in sys.argv[1:]
    example = "--example" in sys.argv[1:]
    if example and local:
        raise SystemExit("--example runs on the real cluster only")
    tree = Path(sys.argv[sys.argv.index("--tree") + 1]).resolve() if "--tree" in sys.argv else REPO
    if tree != REPO and local:
        raise SystemExit("--tree runs on the real cluster only")
    n = int(args[0]) if args else 3
    bytecode = "--bytecode" in sys.argv[1:]
    for cache in (tree / "slurmresume").rglob("__pycache__"):
        shutil.rmtree(cache)
    if bytecode:
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(tree / "slurmresume")], check=True,
                       stdout=subprocess.DEVNULL)
    root = Path(tempfile.mkdtemp(prefix="bench-requeue-")) / "run"
    what, sent = run_local(n, root) if local else run_slurm(n, root, example, tree)
    time.sleep(0.5)
    rows = phases(events(root), sent)
    head = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    print(f"{what}, {'examples/train.py' if example else 'sig_train.py'}, {n} preemptions, 2 gloo ranks, "
          f"tree {tree} ({head or '?'}), bytecode {'compiled first' if bytecode else 'not cached'}, "
          f"medians (min-max) in seconds, {root}")
    for name, vals in rows.items():
        if name == FINE[0]:
            print("  finer:")
        if vals:
            print(f"  {name:82s} {statistics.median(vals):7.2f}  ({min(vals):.2f}-{max(vals):.2f})")
    print(json.dumps({k: [round(v, 3) for v in vals] for k, vals in rows.items()}))


if __name__ == "__main__":
    main()

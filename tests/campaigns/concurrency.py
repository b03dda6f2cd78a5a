"""Campaign 7: concurrency: a writer, two prunes and a status reader at once, while the lock
file is swapped for a symbolic link at seeded random moments.

Each round (--count rounds, ~ROUND_S seconds each, a fresh root) runs, as separate processes
(tests/campaigns/children/concurrency_*.py):
  writer     Checkpointer.save of steps 1, 2, ... (a 4 MiB tensor: saves take a while); logs
             every committed step and every SaveError
  prune A    retention.execute(keep=2, remove_incomplete_older_than=0, young_threshold=0) in a
             loop: only the .inprogress note (and the lock) protect the directory being written
  prune B    `python -m slurmresume prune --keep 2 --yes` in a loop (the CLI: plan, then execute)
  status     status.compute_status + find_latest in a loop; logs what it saw
and, in this process, the lock swapper: at random moments `.slurmresume.lock` is atomically
replaced by a symlink to a victim file outside the root, for a random 20-300 ms.

Guarantees checked: nobody crashes (a prune may refuse the symlinked lock, a save may fail on
it, with a message saying so; any other failure is a bug); no directory with a marker ever fails
verification; the newest complete step seen by status never goes back, and it is never deleted;
every save outside a lock swap commits; the victim file is untouched (content, mode, mtime);
status never calls a checkpoint corrupt; afterwards one prune leaves exactly the newest 2 and
the newest restores exactly.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from campaigns.harness import Report, half_checkpoints, spawn_child

NAME = "concurrency"
DEFAULT_COUNT = 10
ROUND_S = 6.0
LOCK = ".slurmresume.lock"

LOCK_WORDS = ("symbolic link", "Too many levels of symbolic links", "lock file", "not a regular file", "ELOOP")


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for ln in path.read_text().splitlines():
        try:
            out.append(json.loads(ln))
        except ValueError:
            pass
    return out


def one_round(report: Report, work: Path, rng: random.Random, rnd: int) -> None:
    from slurmresume import Checkpointer
    from slurmresume.checkpoint.store import list_checkpoints
    from slurmresume.retention import RetentionPolicy, execute

    base = work / f"round{rnd}"
    shutil.rmtree(base, ignore_errors=True)
    root, stop = base / "root", base / "stop"
    victim = base / "victim"
    base.mkdir(parents=True)
    victim.write_text("precious, not a lock")
    os.chmod(victim, 0o600)
    vstat = victim.stat()
    logs = {k: base / f"{k}.jsonl" for k in ("writer", "pruneA", "pruneB", "status")}
    writer = spawn_child("concurrency_writer", root, stop, logs["writer"])
    deadline = time.time() + 120  # the writer imports torch first
    while not (root / "step_000000001" / "COMMITTED").exists() and time.time() < deadline and writer.poll() is None:
        time.sleep(0.02)
    procs = {"writer": writer, "pruneA": spawn_child("concurrency_pruner", root, stop, logs["pruneA"]),
             "pruneB": spawn_child("concurrency_cli_pruner", root, stop, logs["pruneB"]),
             "status": spawn_child("concurrency_status", root, stop, logs["status"])}
    windows: list[tuple[float, float]] = []
    end = time.time() + ROUND_S
    while time.time() < end:
        time.sleep(rng.uniform(0.1, 0.6))
        t0 = time.time()
        tmp = root / f".lock-swap.{os.getpid()}"
        os.symlink(victim, tmp)
        os.replace(tmp, root / LOCK)
        time.sleep(rng.uniform(0.02, 0.3))
        os.unlink(root / LOCK)  # the next taker creates a fresh regular file
        windows.append((t0, time.time()))
    stop.touch()
    for name, p in procs.items():
        try:
            p.wait(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            report.fail(f"round {rnd}", f"{name} did not stop (hung?)")
        err = p.stderr.read() if p.stderr else ""
        report.check(p.returncode == 0, f"round {rnd}", f"{name} exited {p.returncode}: {err[-800:]}")
    trial = f"round {rnd} (seed {report.seed})"

    def in_window(a: float, b: float, slack: float = 0.5) -> bool:
        return any(a - slack <= w1 and w0 <= b + slack for w0, w1 in windows)

    w = _lines(logs["writer"])
    ok = [e["ok"] for e in w if "ok" in e]
    failed = [e for e in w if "failed" in e]
    report.trials += len(w)
    report.count_stat("saves_committed", len(ok))
    report.count_stat("lock_swaps", len(windows))
    for e in failed:
        about_lock = any(x in e["error"] for x in LOCK_WORDS)
        if about_lock and in_window(e["t0"], e["t1"]):
            report.count_stat("saves_refused_symlinked_lock")
        else:
            report.fail(trial, f"save of step {e['failed']} failed outside a lock swap: {e['error']}")
    for name in ("pruneA",):
        for e in _lines(logs[name]):
            report.trials += 1
            if "crash" in e:
                report.fail(trial, f"{name} crashed: {e['crash']}")
            elif "refused" in e:
                if any(x in e["refused"] for x in LOCK_WORDS):
                    report.count_stat("prunes_refused_symlinked_lock")
                elif "held" in e["refused"]:
                    report.count_stat("prunes_lock_busy")
                else:
                    report.fail(trial, f"{name} refused: {e['refused']}")
            else:
                report.count_stat("prunes_done")
                report.count_stat("dirs_deleted", len(e["deleted"]))
    for e in _lines(logs["pruneB"]):
        report.trials += 1
        report.count_stat("cli_prunes")
        if e.get("rc", 0) > 1:
            report.fail(trial, f"CLI prune exit {e['rc']}: {(base / 'pruneB.jsonl.out').read_text()[-600:]}")
    newest_seen = 0
    for e in _lines(logs["status"]):
        report.trials += 1
        report.count_stat("status_snapshots")
        if "crash" in e:
            report.fail(trial, f"status crashed: {e['crash']}")
            continue
        report.check(not e["corrupt"], trial, f"status called a checkpoint corrupt: {e['corrupt']}")
        n = e["newest"] or 0
        report.check(n >= newest_seen, trial, f"newest complete went back from {newest_seen} to {n}")
        newest_seen = max(newest_seen, n)
    # afterwards
    st = victim.stat()
    report.check(victim.read_text() == "precious, not a lock" and st.st_mode == vstat.st_mode
                 and st.st_mtime_ns == vstat.st_mtime_ns and st.st_size == vstat.st_size, trial,
                 "the symlink target was modified")
    half = half_checkpoints(root)
    report.check(not half, trial, f"marked but not whole: {half}")
    if ok:
        report.check(ok[-1] in [i.step for i in list_checkpoints(root) if i.complete], trial,
                     f"the last committed step {ok[-1]} is gone")
    (root / LOCK).unlink(missing_ok=True)
    execute(root, RetentionPolicy(keep=2))
    done = sorted(i.step for i in list_checkpoints(root) if i.complete)
    report.check(done == sorted(ok)[-2:], trial, f"after a final prune: {done}, committed {sorted(ok)[-3:]}")
    if ok:
        import torch
        from helpers.core import tiny_state

        state = {**tiny_state(0), "big": torch.zeros(1 << 20)}
        with Checkpointer(root, handle_signals=False) as ck:  # closed: an open one keeps its lease beating into root
            got = ck.restore(state, verify=True)
        report.check(got == ok[-1] and torch.equal(state["big"], torch.full((1 << 20,), float(got))), trial,
                     f"restore gave {got}, expected {ok[-1]} with its data")
    shutil.rmtree(base, ignore_errors=True)


def run(report: Report, work: Path) -> None:
    rng = random.Random(report.seed)
    for rnd in range(report.count):
        one_round(report, work, rng, rnd)


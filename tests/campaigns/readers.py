"""Campaign 8: readers listing the root while a writer saves.

Each round (--count rounds of ~ROUND_S seconds) starts a writer process that saves step after
step: single-rank Checkpointer saves with a 4 MiB tensor, alternating with 3-rank saves
(helpers.core.save_as_world: three shards written one after another, then the manifest and
the marker), and three reader processes that loop over `find_latest(root)` and
`list_checkpoints(root)` (sizes only, as restore does). Whenever a reader is told a checkpoint is
complete it immediately opens every shard its manifest lists and checks its size and xxh3
checksum, and checks that the manifest and marker are still there. The writer, the readers and
the negative control's writer are tests/campaigns/children/readers_*.py.

Guarantee: a reader never sees a "complete" checkpoint without all its files whole. In odd rounds
the writer also applies RetentionPolicy(keep=2) after each commit: then a checkpoint may vanish
between "complete" and the check, which is allowed only when its whole directory went (a prune's
single rename) and a newer complete checkpoint exists by then.

Local file systems only: NFS may show another node a just-written file late (PITFALLS.md); the
protocol stays safe there because a reader that sees the marker before the shards finds a size
mismatch or a missing file and calls the directory incomplete, which this campaign also counts.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from campaigns.harness import Report, half_checkpoints, spawn_child

NAME = "readers"
DEFAULT_COUNT = 10
ROUND_S = 5.0
READERS = 3


def one_round(report: Report, work: Path, rnd: int) -> None:
    retain = rnd % 2 == 1
    base = work / f"round{rnd}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    root, stop = base / "root", base / "stop"
    writer = spawn_child("readers_writer", root, stop, "1" if retain else "0", stdout=subprocess.PIPE)
    deadline = time.time() + 120  # the writer imports torch first: start the clock at its first commit
    while not (root / "step_000000001" / "COMMITTED").exists() and time.time() < deadline and writer.poll() is None:
        time.sleep(0.02)
    readers = [spawn_child("readers_reader", root, stop, base / f"reader{i}.jsonl", str(i)) for i in range(READERS)]
    time.sleep(ROUND_S)
    stop.touch()
    trial = f"round {rnd} ({'with' if retain else 'no'} retention)"
    out, err = writer.communicate(timeout=120)
    report.check(writer.returncode == 0, trial, f"writer exited {writer.returncode}: {err[-800:]}")
    report.count_stat("steps_saved", len(out.split()))
    for i, r in enumerate(readers):
        _, rerr = r.communicate(timeout=120)
        report.check(r.returncode == 0, trial, f"reader {i} exited {r.returncode}: {rerr[-800:]}")
        for ln in (base / f"reader{i}.jsonl").read_text().splitlines():
            e = json.loads(ln)
            if "crash" in e:
                report.fail(trial, f"reader {i} crashed: {e['crash']}")
                continue
            if "incomplete_seen" in e:
                report.count_stat("incomplete_seen", e["incomplete_seen"])
                continue
            report.trials += 1
            report.count_stat("complete_observations")
            if "bad" not in e:
                continue
            if retain and e["dir_gone"] and e.get("newer_now"):  # pruned: newer ones exist now
                report.count_stat("pruned_between_list_and_check")
                continue
            report.count_stat("partial_checkpoints_seen_complete")
            report.fail(trial, f"reader {i} saw step {e['step']} complete ({e['how']}) but: {e['bad']}"
                               f"{' (its directory vanished)' if e['dir_gone'] else ''}")
    half = half_checkpoints(root)
    report.check(not half, trial, f"marked but not whole: {half}")
    shutil.rmtree(base, ignore_errors=True)


def control(report: Report, work: Path) -> None:
    """The checker can fail: against children/readers_bad_writer.py (the marker first) the readers
    must report broken "complete" ones."""
    base = work / "control"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    root, stop = base / "root", base / "stop"
    writer = spawn_child("readers_bad_writer", root, stop)
    readers = [spawn_child("readers_reader", root, stop, base / f"reader{i}.jsonl", str(i)) for i in range(READERS)]

    def caught() -> int:
        logs = (base / f"reader{i}.jsonl" for i in range(READERS))
        return sum(1 for log in logs if log.exists() for ln in log.read_text().splitlines() if '"bad"' in ln)

    # At least 2 s, then until a reader catches it (or 60 s): on a starved machine the bad writer
    # may manage only one step in 2 s, and the control failed for want of CPU, not of a check.
    time.sleep(2.0)
    deadline = time.time() + 60
    while not caught() and time.time() < deadline and writer.poll() is None:
        time.sleep(0.2)
    stop.touch()
    for p in (writer, *readers):
        p.communicate(timeout=120)
    report.stats["control_broken_writer_caught"] = n = caught()
    report.check(n > 0, "control", "the readers did not catch a writer that puts the marker first")
    shutil.rmtree(base, ignore_errors=True)


def run(report: Report, work: Path) -> None:
    control(report, work)
    for rnd in range(report.count):
        one_round(report, work, rnd)
    for key in ("partial_checkpoints_seen_complete", "complete_observations"):
        report.stats.setdefault(key, 0)


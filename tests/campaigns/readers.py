"""Campaign 8: readers listing the root while a writer saves.

Each round (--count rounds of ~ROUND_S seconds) starts a writer process that saves step after
step: single-rank Checkpointer saves with a 4 MiB tensor, alternating with 3-rank saves
(helpers.core.save_as_world: three shards written one after another, then the manifest and
the marker), and three reader processes that loop over `find_latest(root)` and
`list_checkpoints(root)` (sizes only, as restore does). Whenever a reader is told a checkpoint is
complete it immediately opens every shard its manifest lists and checks its size and xxh3
checksum, and checks that the manifest and marker are still there.

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
import sys
import time
from pathlib import Path

from campaigns.harness import REPO, TESTS, Report, half_checkpoints

NAME = "readers"
DEFAULT_COUNT = 10
ROUND_S = 5.0
READERS = 3

WRITER = r"""
import sys, pathlib, torch
sys.path.insert(0, sys.argv[3])
from helpers.core import tiny_state, save_as_world
from slurmresume import Checkpointer, RetentionPolicy
root, stop, retain = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[4] == "1"
ck = Checkpointer(root, handle_signals=False, retention=RetentionPolicy(keep=2) if retain else None)
step = 0
while not stop.exists():
    step += 1
    if step % 2:
        ck.save(step, {**tiny_state(step), "big": torch.full((1 << 20,), float(step))})
    else:
        save_as_world(root, step, 3)
        if retain:
            ck._apply_retention()
    print(step, flush=True)
"""

# The negative control: a writer that breaks the protocol as safetensors #762 did (the marker
# first, then a shard preallocated to its final size and filled in place). Readers must catch it.
BAD_WRITER = r"""
import os, sys, time, pathlib, xxhash, json
from slurmresume.checkpoint.manifest import marker_bytes
root, stop = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
root.mkdir(parents=True, exist_ok=True)
step = 0
while not stop.exists():
    step += 1
    data = os.urandom(1 << 20)
    d = root / f"step_{step:09d}"
    d.mkdir()
    m = {"format": "slurmresume/1", "step": step, "world_size": 1, "created": time.time(), "tensors": [],
         "shards": [{"file": "rank-00000-of-00001.safetensors", "rank": 0, "bytes": len(data),
                     "xxh3": xxhash.xxh3_64_hexdigest(data)}], "metrics": None, "meta": None}
    raw = json.dumps(m).encode()
    (d / "manifest.json").write_bytes(raw)
    (d / "COMMITTED").write_bytes(marker_bytes(step, raw))
    with open(d / "rank-00000-of-00001.safetensors", "wb") as f:
        f.truncate(len(data))
        for i in range(0, len(data), 1 << 16):
            f.seek(i)
            f.write(data[i:i + (1 << 16)])
            f.flush()
            time.sleep(0.002)
"""

READER = r"""
import json, os, sys, time, pathlib, traceback
from slurmresume.checkpoint.store import find_latest, list_checkpoints
from slurmresume.checkpoint.shard import hash_file
from slurmresume.errors import CorruptCheckpointError
root, stop, log, me = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), open(sys.argv[3], "a"), int(sys.argv[4])
n = 0
while not stop.exists():
    n += 1
    try:
        infos = [find_latest(root, warn=False)] if (n + me) % 2 else list_checkpoints(root)
        newest = max((i.step for i in infos if i is not None and i.complete), default=None)
        for info in infos:
            if info is None or not info.complete:
                continue
            rec = {"step": info.step, "newest": info.step == newest, "how": "latest" if (n + me) % 2 else "list"}
            try:
                for s in info.manifest.shards:
                    digest = hash_file(info.path, s["file"], s["bytes"])
                    if digest != s["xxh3"]:
                        rec["bad"] = f"{s['file']} checksum {digest} != {s['xxh3']}"
                for f in ("manifest.json", "COMMITTED"):
                    if not (info.path / f).is_file():
                        rec["bad"] = f"{f} missing"
            except CorruptCheckpointError as exc:
                rec["bad"] = str(exc)
            rec["dir_gone"] = not os.path.lexists(info.path)
            if "bad" in rec and rec["dir_gone"]:
                now = find_latest(root, warn=False)
                rec["newer_now"] = now is not None and now.step > info.step
            log.write(json.dumps(rec) + "\n")
        log.write(json.dumps({"incomplete_seen": sum(1 for i in infos if i is not None and not i.complete)}) + "\n")
    except Exception:
        log.write(json.dumps({"crash": traceback.format_exc()[-1500:]}) + "\n")
    log.flush()
"""


def _spawn(args: list[str], out: int | None = subprocess.DEVNULL) -> subprocess.Popen:
    from helpers.procs import clean_env

    return subprocess.Popen([sys.executable, *args], env=clean_env(), cwd=str(REPO), stdout=out,
                            stderr=subprocess.PIPE, text=True)


def one_round(report: Report, work: Path, rnd: int) -> None:
    retain = rnd % 2 == 1
    base = work / f"round{rnd}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    root, stop = base / "root", base / "stop"
    writer = _spawn(["-c", WRITER, str(root), str(stop), str(TESTS), "1" if retain else "0"], out=subprocess.PIPE)
    deadline = time.time() + 120  # the writer imports torch first: start the clock at its first commit
    while not (root / "step_000000001" / "COMMITTED").exists() and time.time() < deadline and writer.poll() is None:
        time.sleep(0.02)
    readers = [_spawn(["-c", READER, str(root), str(stop), str(base / f"reader{i}.jsonl"), str(i)])
               for i in range(READERS)]
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
    """The checker can fail: against BAD_WRITER the readers must report broken "complete" ones."""
    base = work / "control"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    root, stop = base / "root", base / "stop"
    writer = _spawn(["-c", BAD_WRITER, str(root), str(stop)])
    readers = [_spawn(["-c", READER, str(root), str(stop), str(base / f"reader{i}.jsonl"), str(i)])
               for i in range(READERS)]
    time.sleep(2.0)
    stop.touch()
    for p in (writer, *readers):
        p.communicate(timeout=120)
    caught = sum(1 for i in range(READERS) for ln in (base / f"reader{i}.jsonl").read_text().splitlines()
                 if '"bad"' in ln)
    report.stats["control_broken_writer_caught"] = caught
    report.check(caught > 0, "control", "the readers did not catch a writer that puts the marker first")
    shutil.rmtree(base, ignore_errors=True)


def run(report: Report, work: Path) -> None:
    control(report, work)
    for rnd in range(report.count):
        one_round(report, work, rnd)
    for key in ("partial_checkpoints_seen_complete", "complete_observations"):
        report.stats.setdefault(key, 0)


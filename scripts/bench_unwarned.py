"""The unwarned-failure campaign (issue 47): `submit --local examples/train.py` with default flags,
one random rank's process tree SIGKILLed at a seeded random moment per run, N runs per rank count.
Per kill: the failure save's outcome, the steps trained twice, the seconds from the kill to the
first resumed step (the launcher's `resumed` event), and whether the last step equals an
uninterrupted run's bit for bit.

    python3 scripts/bench_unwarned.py --ranks 2 4 --kills 20 --seed 47
    python3 scripts/bench_unwarned.py --shape fsdp2 --ranks 4 --kills 3   # refused: resumes the periodic step
    python3 scripts/bench_unwarned.py --shape hsdp --ranks 4 --kills 3    # 2x2: committed from the replica peer
    python3 scripts/bench_unwarned.py --shape fsdp2 --ranks 4 --kills 5 --nodes 2 --snapshot-every 1
    python3 scripts/bench_unwarned.py --shape fsdp2 --ranks 4 --kills 5 --nodes 2 --snapshot-every 1 --lose node

Single node, CPU/gloo. Each run trains `--steps` steps (periodic save every `--save-every`), so a
kill without a failure save would repeat up to `--save-every` steps. `--shape` picks the run: DDP
(examples/train.py), or tests/helpers/sharded_train.py's FSDP2 (every piece on one rank: the
failure save must refuse, naming the dead rank's pieces) or HSDP (replicate=2 x shard=ranks/2: it
must commit, the dead rank's pieces written by its replica peer).

`--nodes 2` (issue 49): two emulated nodes of one Slurm job on this host (the real NodeLauncher
twice, tests/helpers/twonodes.py: c10d across them, the rendezvous order the reverse of the Slurm
order, each node its own memory tier root), with `--snapshot-every`. `--lose rank` SIGKILLs one
rank's tree (the restart inside the allocation restores from memory when every node holds a
snapshot at least as new as the file tier's); `--lose node` SIGKILLs the whole tree of the node
holding the victim (launcher, torchrun, ranks: its memory is gone): the survivor commits the
newest step it holds whole from its memory and the lost node's peer copy (`memory_promoted`),
requeues, and the bench starts both launchers again as Slurm's requeue would. What it skips: a
real network between the nodes (loopback), real tmpfs per host (one /dev/shm-like directory per
emulated node under the bench's temporary directory), Slurm itself (a fake `scontrol`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.procs import rank_pid, signal_tree  # noqa: E402  (the tests' own process-tree walk)

EXAMPLE = REPO / "examples" / "train.py"
SHARDED = REPO / "tests" / "helpers" / "sharded_train.py"


def script_for(shape: str) -> tuple[Path, list[str]]:
    """The training script and its extra arguments for `--shape`."""
    return (EXAMPLE, []) if shape == "ddp" else (SHARDED, ["--shape", shape])


def submit(root: Path, ranks: int, args: list[str], record: Path | None,
           script: Path = EXAMPLE) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "SLURMRESUME_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONHASHSEED="0", PYTHONPATH=str(REPO))
    if record is not None:
        env["SLURMRESUME_DRILL_RECORD"] = str(record)
    return subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", str(script), "--ckpt-dir", str(root),
                             "--local", "--nproc-per-node", str(ranks), "--", *args], env=env, cwd=root.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def records(directory: Path, rank: int) -> list[dict]:
    path = directory / f"rank-{rank}.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def events(root: Path) -> list[dict]:
    return [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines() if line.strip()]


def one_kill(work: Path, ranks: int, args: list[str], steps: int, save_every: int, rng: random.Random,
             reference: Path, script: Path = EXAMPLE) -> dict:
    from slurmresume.checkpoint.layout import step_dir_name
    from slurmresume.tools.compare import compare_checkpoints

    root, record = work / "root", work / "record"
    at, victim = rng.randint(save_every + 2, steps - 3), rng.randrange(ranks)
    proc = submit(root, ranks, args, record, script)
    while max((r["step"] for r in records(record, 0)), default=0) < at and proc.poll() is None:
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.1))
    pid = rank_pid(proc.pid, victim)
    if pid is None:
        raise SystemExit(f"rank {victim} not found (the run ended? {proc.poll()})")
    signal_tree(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=1200)
    ev = events(root)
    save = next((e for e in ev if e["event"] == "failure_save"), {})
    restored = next((e["step"] for e in ev if e["event"] == "restored"), None)
    first = records(record, 0)[0]["run"]
    trained = max(r["step"] for k in range(ranks) for r in records(record, k) if r["run"] == first)
    resumed = next((e.get("seconds") for e in ev if e["event"] == "resumed"), None)
    final = root / step_dir_name(steps)
    same = proc.returncode == 0 and final.exists() and not compare_checkpoints(reference, final)
    return {"script": script.name, "ranks": ranks, "victim": victim, "after_step": at, "exit": proc.returncode,
            "failure_save": f"step {save.get('step')}" if save.get("committed") else
            ("refused: " + "; ".join(save.get("missing") or [str(save.get("error"))]) if save else "none"),
            "restored": restored, "repeated": None if restored is None else trained - restored,
            "resume_s": resumed, "bitwise": same, "stderr_tail": "" if same else err[-800:]}


def one_kill_nodes(work: Path, ranks: int, args: list[str], steps: int, save_every: int, rng: random.Random,
                   reference: Path, script: Path, lose: str, every: str) -> dict:
    """One seeded kill on two emulated nodes (see the module docstring)."""
    from helpers.procs import free_port, process_tree
    from helpers.twonodes import agent_started, finish_all, global_rank_pid, node_launcher

    from slurmresume.checkpoint.layout import step_dir_name
    from slurmresume.tools.compare import compare_checkpoints

    root, record = work / "ckpt", work / "record"
    at, victim = rng.randint(save_every + 2, steps - 3), rng.randrange(ranks)
    env = {"SLURMRESUME_DRILL_RECORD": str(record), "OMP_NUM_THREADS": "1"}  # PYTHONPATH: this process's

    def both(restart: int) -> list[subprocess.Popen[str]]:
        port, out = free_port(), []
        for node in (1, 0):  # node 1 first: it gets ranks 0..ranks/2-1
            shm = work / f"shm{node}-{restart}"
            shm.mkdir()
            out.insert(0, node_launcher(work, node, port, script, args, procs=ranks // 2, job_id="4900",
                                        spec_kw=f"snapshot_every={every!r}",
                                        env={**env, "SLURMRESUME_MEMORY_BASE": str(shm),
                                             "SLURM_RESTART_COUNT": str(restart)}))
            if node == 1:
                agent_started(out[0].pid)
        return out

    launchers = both(0)
    lags: list[tuple[int, int]] = []  # per sample and node: (newest snapshot - its acked replica, - the pinned keep)
    while max((r["step"] for r in records(record, 0)), default=0) < at and all(p.poll() is None for p in launchers):
        lags += replica_lags(work)
        time.sleep(0.01)
    time.sleep(rng.uniform(0.0, 0.1))
    pid = global_rank_pid(launchers, victim, script.name.encode())
    if pid is None:
        raise SystemExit(f"rank {victim} not found (the run ended? {[p.poll() for p in launchers]})")
    killed = next(p for p in launchers if pid in process_tree(p.pid)) if lose == "node" else None
    signal_tree(killed.pid if killed is not None else pid, signal.SIGKILL)
    outs = finish_all(launchers, 1200)
    if lose == "node":
        outs += finish_all(both(1), 1200)  # the requeued job: both nodes again
    ev = events(root)
    save = next((e for e in ev if e["event"] == "failure_save"), {})
    promoted = next((e for e in ev if e["event"] == "memory_promoted" and e.get("committed") is not None), {})
    restored = next((e for e in ev if e["event"] == "restored"), {})
    first = records(record, 0)[0]["run"]
    trained = max(r["step"] for k in range(ranks) for r in records(record, k) if r["run"] == first)
    final = root / step_dir_name(steps)
    same = final.exists() and not compare_checkpoints(reference, final)
    taken = save.get("from_snapshot")  # ranks whose pieces came from their memory snapshot (train/memshard.py)
    return {"script": script.name, "ranks": ranks, "nodes": 2, "lose": lose, "victim": victim, "after_step": at,
            "failure_save": (f"step {save.get('step')}" + (f" (rank {taken} from its memory snapshot)" if taken else ""))
            if save.get("committed") else ("refused" if save else "none"),
            "promoted": (f"step {promoted.get('step')}" if promoted.get("committed") else
                         f"no: {promoted.get('why')}") if promoted else None,
            "restored": restored.get("step"), "tier": restored.get("tier"),
            "repeated": None if restored.get("step") is None else trained - restored["step"],
            "resume_s": next((e.get("seconds") for e in ev if e["event"] == "resumed"), None), "bitwise": same,
            **lag_summary(lags),
            "stderr_tail": "" if same else "\n".join(o[-800:] for o in outs)}


def replica_lags(work: Path) -> list[tuple[int, int]]:
    """Each emulated node's replica lag now, from its memory root's files (peerpin.py): its
    newest committed snapshot minus the newest step its successor acked, and minus the step kept
    for a promotion (every successor acked). Nodes with no ack yet are left out."""
    from slurmresume.checkpoint.store import newest_committed
    from slurmresume.peerpin import read_acked, read_pins

    out = []
    for mem in work.glob("shm*-0/slurmresume-mem-*"):
        newest, (acked, _), keep = newest_committed(mem), read_acked(mem), read_pins(mem).keep
        if newest is not None and acked is not None and keep is not None:
            out.append((newest - acked, newest - keep))
    return out


def lag_summary(lags: list[tuple[int, int]]) -> dict[str, str | None]:
    """Median and max over the samples, in steps (`lag`: to the acked replica; `keep_lag`: to the
    step a promotion would take)."""
    if not lags:
        return {"lag": None, "keep_lag": None}
    acked, kept = [a for a, _ in lags], [k for _, k in lags]
    return {"lag": f"{statistics.median(acked):g}/{max(acked)}", "keep_lag": f"{statistics.median(kept):g}/{max(kept)}"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--kills", type=int, default=20, help="kills per rank count (default: 20)")
    p.add_argument("--seed", type=int, default=47)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--shape", choices=["ddp", "fsdp2", "hsdp"], default="ddp",
                   help="ddp: examples/train.py; fsdp2, hsdp: tests/helpers/sharded_train.py (default: ddp)")
    p.add_argument("--nodes", type=int, choices=[1, 2], default=1,
                   help="1: submit --local; 2: two emulated nodes of one Slurm job (default: 1)")
    p.add_argument("--lose", choices=["rank", "node"], default="rank",
                   help="with --nodes 2: SIGKILL one rank, or the whole node holding it (default: rank)")
    p.add_argument("--snapshot-every", default="off", metavar="auto|N|off",
                   help="with --nodes 2: the memory tier's interval (default: off)")
    a = p.parse_args()
    if a.nodes == 2 and any(r % 2 for r in a.ranks):
        p.error(f"--nodes 2 needs an even number of ranks, got {a.ranks}")
    if a.shape == "hsdp" and any(r % 2 for r in a.ranks):
        p.error(f"--shape hsdp needs an even number of ranks (replicate=2 x shard=ranks/2), got {a.ranks}")
    script, extra = script_for(a.shape)
    args = [*extra, "--steps", str(a.steps), "--save-every", str(a.save_every), "--step-sleep", "0.05"]
    rng = random.Random(a.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-unwarned-") as tmp:
        for ranks in a.ranks:
            ref = Path(tmp) / f"ref-{ranks}" / "root"
            ref.parent.mkdir()
            proc = submit(ref, ranks, args, None, script)
            if proc.wait(timeout=1200) != 0:
                raise SystemExit(f"the uninterrupted run on {ranks} ranks failed: {proc.stderr.read()[-2000:]}")
            for i in range(a.kills):
                work = Path(tmp) / f"kill-{ranks}-{i}"
                work.mkdir()
                final = ref / f"step_{a.steps:09d}"
                row = (one_kill(work, ranks, args, a.steps, a.save_every, rng, final, script) if a.nodes == 1 else
                       one_kill_nodes(work, ranks, args, a.steps, a.save_every, rng, final, script, a.lose,
                                      a.snapshot_every))
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if v != ""}), flush=True)
                shutil.rmtree(work, ignore_errors=True)
    ok = [r for r in rows if r["repeated"] is not None and r["repeated"] <= 1]
    secs = [r["resume_s"] for r in rows if r["resume_s"] is not None]
    print(f"{len(rows)} kills: steps repeated <= 1 in {len(ok)} ({100 * len(ok) / max(1, len(rows)):.0f} %); "
          f"failure save committed in {sum(r['failure_save'].startswith('step') for r in rows)}; "
          f"bitwise {sum(r['bitwise'] for r in rows)} of {len(rows)}; "
          f"kill -> first resumed step median {statistics.median(secs) if secs else float('nan'):.1f} s")
    return 0 if all(r["bitwise"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

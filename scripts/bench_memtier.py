"""An in-allocation restore from the memory tier (issue 49: a snapshot on the node's tmpfs, in the
file format) against the same restore from the file tier, with the page cache dropped before
each, interleaved round by round (the order alternates) on the same state.

    python scripts/bench_memtier.py [--mib-per-rank 1024] [--nproc 2] [--rounds 5] [--dir DIR] [--memory-base /dev/shm]

`--nproc` ranks of one node (gloo, spawned here), each restoring its own shard at once, as a
restarted node does. The restore is what a restarted rank runs: `Checkpointer.restore` into the
live state it has built (tensors allocated once, as a restarted script's model is), every byte
checked against its digest in both tiers; a round's time is the slowest rank's (the restore is
collective). The cache is dropped with /proc/sys/vm/drop_caches (as root), else with
POSIX_FADV_DONTNEED on the file tier's shards; tmpfs pages are the memory tier itself and stay.
`--dir` should be on the file system the checkpoints go to (the default is a temporary
directory, often on the same disk). Prints one JSON object: per-round seconds, medians with their
spread, the ratio of the medians and each round's own ratio, the load average.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from slurmresume import Checkpointer
from slurmresume.checkpoint.collective import Group
from slurmresume.contract import ENV_MEMORY_DIR, ENV_SNAPSHOT_EVERY
from slurmresume.train import memrestore
from slurmresume.train.saving import payload_of, save_collective

TENSORS = 32  # a transformer-like state: a few dozen large tensors


def make_state(nbytes: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = max(1, nbytes // 4 // TENSORS)
    return {f"layer{i}.weight": torch.randn(n, generator=g) for i in range(TENSORS)}


def drop_cache(root: Path) -> str:
    """How the cache was dropped: "drop_caches" (everything, as root) or "fadvise" (the shards)."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for p in root.rglob("*.safetensors"):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def restore(root: Path, memory: Path | None, state: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Seconds of one `Checkpointer.restore` and the tier it read (rank 0: from the `restored` event)."""
    os.environ[ENV_MEMORY_DIR] = str(memory or "")
    os.environ[ENV_SNAPSHOT_EVERY] = "1" if memory else "off"
    ck = Checkpointer(root, handle_signals=False)
    t = time.perf_counter()
    step = ck.restore(state)
    dt = time.perf_counter() - t
    ck.close()
    assert step == 1, step
    if int(os.environ.get("RANK", "0")) != 0:  # rank 0 writes the event, after the last collective
        return dt, ""
    last = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines() if '"restored"' in line][-1]
    return dt, str(last.get("tier", "file"))


mapped_reads = memrestore.reading_mapped


def rank_main(rank: int, a: argparse.Namespace, root: Path, memory: Path, port: int, out: Path) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(a.nproc),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(a.nproc))
    torch.set_num_threads(1)  # a node's ranks share its cores
    if a.nproc > 1:
        dist.init_process_group("gloo", rank=rank, world_size=a.nproc)
    group = Group.create()
    state = make_state(a.mib_per_rank << 20, 1 + rank)
    for where in (root, memory):
        result = save_collective(group, where, 1, payload_of(1, state, None, None), replace_if_changed=False)
        assert result.outcome is None or result.outcome.ok, result
    live = make_state(a.mib_per_rank << 20, 100 + rank)  # the restarted rank's state, built before restore
    arms = ["memory", "file"] + (["memory_pread"] if a.with_pread else [])
    times: dict[str, list[float]] = {k: [] for k in arms}
    dropped = ""

    def barrier() -> None:
        if a.nproc > 1:
            dist.barrier()

    for tier_root in (memory, None):  # warm-up, not measured: the restore path's lazy imports
        restore(root, tier_root, live)
    for r in range(a.rounds):
        for arm in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotate which goes first
            tier = arm.split("_")[0]
            for t in live.values():
                t.zero_()  # the restore must write every byte again
            barrier()
            if rank == 0:
                dropped = drop_cache(root)
            barrier()
            memrestore.reading_mapped = contextlib.nullcontext if arm == "memory_pread" else mapped_reads
            dt, got = restore(root, memory if tier == "memory" else None, live)
            assert got in (tier, ""), (tier, got)
            assert all(torch.equal(live[k], state[k]) for k in state)
            slowest = group.max_ints([int(dt * 1e6)])[0] / 1e6
            times[arm].append(round(slowest, 4))
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        out.write_text(json.dumps({
            "bench": "memtier", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "mib_per_rank": a.mib_per_rank, "nproc": a.nproc, "rounds": a.rounds, "file_root": str(root),
            "memory_root": str(memory), "cache": dropped, "seconds": times, "median_s": med,
            "spread_s": {k: [min(v), max(v)] for k, v in times.items()},
            "file_over_memory": round(med["file"] / med["memory"], 2) if med["memory"] else None,
            # the same round's file / memory: paired, so load that shifts between rounds cancels
            "per_round_file_over_memory": [round(f / m, 2) for f, m in zip(times["file"], times["memory"])],
            **({"file_over_memory_pread": round(med["file"] / med["memory_pread"], 2)} if a.with_pread else {}),
            "loadavg": os.getloadavg()}))
    if a.nproc > 1:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib-per-rank", type=int, default=1024, help="state per rank, MiB (default 1024)")
    ap.add_argument("--nproc", type=int, default=2, help="ranks of the node (default 2)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--dir", default=None, help="where the file tier's root goes (default: a temporary directory)")
    ap.add_argument("--memory-base", default="/dev/shm", help="where the memory root goes (default /dev/shm)")
    ap.add_argument("--with-pread", action="store_true", help="a third arm: the memory tier read with pread, as "
                    "before checkpoint/mapped.py (default: off)")
    a = ap.parse_args()
    if a.rounds < 1 or a.mib_per_rank < 1 or a.nproc < 1:
        sys.exit("bench_memtier: --rounds, --mib-per-rank and --nproc must be >= 1")
    base = Path(a.dir or tempfile.mkdtemp(prefix="bench-memtier-"))
    root, memory = base / "root", Path(tempfile.mkdtemp(prefix="bench-memtier-", dir=a.memory_base))
    out = base / "result.json"
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if a.nproc == 1:
            rank_main(0, a, root, memory, port, out)
        else:
            import torch.multiprocessing as mp

            mp.spawn(rank_main, args=(a, root, memory, port, out), nprocs=a.nproc)
        print(out.read_text())
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            out.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

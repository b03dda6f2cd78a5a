"""The price of a resharding restore's exchange: one step restored both ways, interleaved.

checkpoint/exchange.py: each rank reading its own boxes (SLURMRESUME_RESHARD_EXCHANGE=0) against
each saved shard read by one rank and sent over gloo (=1), the page cache dropped before each.

    python scripts/bench_exchange.py --mib 1024 --save 4 --restore 3 --rounds 5 --dir /tmp/bench-exchange

The state: TENSORS fp32 DTensors, Shard(0), of row counts that chunk unevenly (as a model's do),
saved by --save ranks (torchrun), restored by --restore ranks into zeros. Per restore: the slowest
rank's `restore()` seconds, the shard files all ranks opened (audit hook), every value checked.
Prints medians with min-max per mode and the ratio exchange / direct, with the date.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench import drop_caches  # noqa: E402 - scripts/ is this script's own directory

ROWS = (4096, 11008, 4096, 32000, 1024, 11008)  # 7B-like row counts (uneven chunks at a reshard)


def _shapes(mib: int) -> list[tuple[int, int]]:
    cols = max(1, mib * (1 << 20) // (4 * sum(ROWS)))
    return [(r, cols) for r in ROWS]


def worker(mode: str, root: Path, out: Path, mib: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    import slurmresume

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    shapes = _shapes(mib)

    def full(i: int, shape: tuple[int, int]) -> torch.Tensor:
        return torch.arange(shape[0], dtype=torch.float32).unsqueeze(1).expand(shape) * (i + 1)

    ck = slurmresume.Checkpointer(root, handle_signals=False)
    if mode == "save":
        ck.save(1, {"w": {f"w{i}": distribute_tensor(full(i, s), mesh, [Shard(0)]) for i, s in enumerate(shapes)}})
        ck.close()
        return
    opens: list[str] = []
    sys.addaudithook(lambda e, a: opens.append(os.path.basename(os.fsdecode(a[0])))
                     if e == "open" and isinstance(a[0], (str, bytes)) and ".safetensors" in os.fsdecode(a[0]) else None)
    boxes = [slice(*_rows(s[0], world, rank)) for s in shapes]
    state = {"w": {f"w{i}": DTensor.from_local(torch.zeros((b.stop - b.start, s[1])), mesh, [Shard(0)],
                                               shape=torch.Size(s), stride=(s[1], 1))
                   for i, (s, b) in enumerate(zip(shapes, boxes))}}
    dist.barrier()
    started = time.perf_counter()
    ck.restore(state, restore_rng=False)
    seconds = time.perf_counter() - started
    ok = all(torch.equal(state["w"][f"w{i}"].to_local(), full(i, s)[b]) for i, (s, b) in enumerate(zip(shapes, boxes)))
    (out / f"{rank}.json").write_text(json.dumps({"seconds": seconds, "opens": sorted(set(opens)), "ok": ok}))
    ck.close()


def _rows(n: int, world: int, rank: int) -> tuple[int, int]:
    chunk = -(-n // world)
    return min(rank * chunk, n), min(rank * chunk + chunk, n)


def _torchrun(n: int, args: list[str], env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                    __file__, "--worker", *args], check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="state size (MiB, fp32) (default: 1024)")
    ap.add_argument("--save", type=int, default=4, help="ranks that save (default: 4)")
    ap.add_argument("--restore", type=int, default=3, help="ranks that restore (default: 3)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: 5)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-exchange"), help="(default: /tmp/bench-exchange)")
    ap.add_argument("--worker", nargs=1, metavar="MODE", help=argparse.SUPPRESS)
    args = ap.parse_args()
    root, out = args.dir / "ck", args.dir / "out"
    if args.worker:
        return worker(args.worker[0], root, out, args.mib)
    shutil.rmtree(args.dir, ignore_errors=True)
    out.mkdir(parents=True)
    common = ["--mib", str(args.mib), "--dir", str(args.dir)]
    _torchrun(args.save, ["save", *common], {})
    times: dict[str, list[float]] = {"0": [], "1": []}
    opened: dict[str, int] = {}
    dropped = True
    for r in range(args.rounds):
        for mode in (("0", "1") if r % 2 == 0 else ("1", "0")):
            dropped = drop_caches() and dropped
            _torchrun(args.restore, ["restore", *common], {"SLURMRESUME_RESHARD_EXCHANGE": mode})
            got = [json.loads((out / f"{k}.json").read_text()) for k in range(args.restore)]
            if not all(g["ok"] for g in got):
                sys.exit(f"mode {mode}: wrong values restored")
            times[mode].append(max(g["seconds"] for g in got))
            opened[mode] = sum(len(g["opens"]) for g in got)
    med = {m: statistics.median(t) for m, t in times.items()}
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC: {args.mib} MiB saved by {args.save} "
          f"ranks, restored by {args.restore}, {args.rounds} interleaved rounds"
          f"{', page cache dropped before each' if dropped else ' (page cache NOT dropped: not root)'}")
    for mode, name in (("0", "direct (each rank reads its boxes)"), ("1", "exchange (one reader a shard)")):
        print(f"  {name}: median {med[mode]:.3f} s (min {min(times[mode]):.3f}, max {max(times[mode]):.3f}), "
              f"shard files opened by all ranks {opened[mode]}")
    print(f"  exchange / direct: {med['1'] / med['0']:.2f}x")
    return None


if __name__ == "__main__":
    main()

"""Resharding benchmark: a DTensor checkpoint saved by 4 ranks (dim-0 sharded), restored on 2
ranks (Shard(0) and Shard(1)); bytes each rank read vs the checkpoint and vs its share, and the
peak memory of `slurmresume export` vs the largest tensor and the model.

    python scripts/bench_reshard.py --mib 128 --dir /tmp/bench-reshard [--json out.json]

Bytes are counted twice: the reader's own counter (tensor bytes it preads) and the change of
/proc/self/io rchar around `restore()` (every read syscall of the process: headers, manifest).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

TENSORS = 8
COLS = 2048


def _rchar() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    return -1


def worker(mode: str, root: Path, out: Path, mib: int, dim: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import slurmresume
    from slurmresume.checkpoint import reshard

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    rows = mib * (1 << 20) // (TENSORS * COLS * 4)
    shape = torch.Size((rows, COLS))
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    if mode == "save":  # each rank makes only its own piece: rank r's rows hold the value r
        local = {f"w{i}": torch.full((rows // world, COLS), float(rank * 100 + i)) for i in range(TENSORS)}
        state = {"w": {k: DTensor.from_local(v, mesh, [Shard(0)], shape=shape, stride=(COLS, 1))
                       for k, v in local.items()}}
        ck.save(1, state)
        ck.close()
        return
    placements = [Shard(dim)]
    lshape = (rows // world, COLS) if dim == 0 else (rows, COLS // world)
    state = {"w": {f"w{i}": DTensor.from_local(torch.zeros(lshape), mesh, placements, shape=shape,
                                               stride=(COLS, 1)) for i in range(TENSORS)}}
    reshard.STATS.update(bytes=0, reads=0)
    before, started = _rchar(), time.perf_counter()
    ck.restore(state)
    seconds, rchar = time.perf_counter() - started, _rchar() - before
    saved_rows = rows // 4
    ok = all(torch.equal(state["w"][f"w{i}"].full_tensor()[::saved_rows, 0],
                         torch.tensor([r * 100.0 + i for r in range(4)])) for i in range(TENSORS))
    info = {"rank": rank, "dim": dim, "bytes": reshard.STATS["bytes"], "reads": reshard.STATS["reads"],
            "rchar": rchar, "seconds": round(seconds, 4), "ok": ok}
    (out / f"restore-{dim}-{rank}.json").write_text(json.dumps(info))
    ck.close()


def _torchrun(n: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
                    __file__, "--worker", *args], check=True, env=env, stdout=subprocess.DEVNULL)


def _peak_rss_mib(args: list[str]) -> float:
    """Peak RSS (MiB) of one child process, through a wrapper so each child is measured alone."""
    code = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL);"
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    res = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    return int(res.stdout.strip()) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=128, help="checkpoint size (MiB, fp32)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/bench-reshard"))
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "DIM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    root, out = args.dir / "ck", args.dir / "out"
    if args.worker:
        return worker(args.worker[0], root, out, args.mib, int(args.worker[1]))
    shutil.rmtree(args.dir, ignore_errors=True)
    out.mkdir(parents=True)
    _torchrun(4, "save", "0", "--mib", str(args.mib), "--dir", str(args.dir))
    step = root / "step_000000001"
    total = sum(p.stat().st_size for p in step.glob("*.safetensors"))
    tensor_bytes = args.mib << 20
    rows = []
    for dim in (0, 1):
        _torchrun(2, "restore", str(dim), "--mib", str(args.mib), "--dir", str(args.dir))
        for rank in (0, 1):
            r = json.loads((out / f"restore-{dim}-{rank}.json").read_text())
            r.update(share=tensor_bytes // 2, of_checkpoint=round(r["bytes"] / total, 4),
                     of_share=round(r["bytes"] / (tensor_bytes // 2), 4))
            rows.append(r)
    cli = [sys.executable, "-m", "slurmresume"]
    base = _peak_rss_mib([*cli, "export", "--help"])
    peak = _peak_rss_mib([*cli, "export", str(step), "--only", "w", "--out", str(args.dir / "w.safetensors")])
    export = {"peak_rss_mib": round(peak, 1), "baseline_rss_mib": round(base, 1),
              "largest_tensor_mib": args.mib / TENSORS, "model_mib": args.mib}
    result = {"checkpoint_bytes": total, "tensor_bytes": tensor_bytes, "restore_on_2": rows, "export": export}
    print(f"checkpoint: 4 ranks, {TENSORS} x [{args.mib * (1 << 20) // (TENSORS * COLS * 4)}, {COLS}] "
          f"fp32 Shard(0), {total / 2**20:.1f} MiB on disk")
    print("| restore on 2 ranks as | rank | bytes read (MiB) | of checkpoint | of its share | preads | rchar (MiB) | s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| Shard({r['dim']}) | {r['rank']} | {r['bytes'] / 2**20:.1f} | {r['of_checkpoint']:.3f} | "
              f"{r['of_share']:.3f} | {r['reads']} | {r['rchar'] / 2**20:.1f} | {r['seconds']:.2f} |"
              + ("" if r["ok"] else " WRONG VALUES"))
    print(f"export: peak RSS {peak:.0f} MiB (the CLI alone: {base:.0f} MiB; +{peak - base:.0f} MiB) for a "
          f"{args.mib} MiB model whose largest tensor is {args.mib / TENSORS:.0f} MiB")
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return None


if __name__ == "__main__":
    main()

"""Test helper (gloo ranks, forked by procs.run_ranks; torchrun works too): a DTensor that rank 0
does not hold.

    submesh_restore.py OUT ROOT save|restore

save: ranks 1 and 2 of 3 hold a Shard(0) DTensor of 6 x 2 on a mesh over ranks [1, 2] (a
pipeline stage's parameter); rank 0 holds only a plain tensor, so the manifest's once-per-tensor
section (rank 0's) does not list it. restore: the same ranks, the stage now Shard(1) (a rank's
box spans both saved pieces); each rank restores into zeroed state and writes OUT/r.json: the
step restored, whether its part of every tensor came back bitwise, and any error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

import slurmresume


def state(mesh: DeviceMesh, rank: int, step: int, dim: int) -> dict:
    out: dict = {"plain": torch.full((4,), float(step))}
    if rank in (1, 2):
        out["stage"] = distribute_tensor(torch.arange(12.0).reshape(6, 2) + step, mesh, [Shard(dim)])
    return out


def main(argv: list[str]) -> int:
    out, root, mode = Path(argv[0]), Path(argv[1]), argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [1, 2])  # every rank creates it; rank 0 is not in it
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    dim = 0 if mode == "save" else 1
    expected = state(mesh, rank, 1, dim)
    step, error = None, None
    if mode == "save":
        ck.save(1, expected)
        step = 1
    else:
        fresh = {k: v * 0 for k, v in state(mesh, rank, 0, dim).items()}
        try:
            step = ck.restore(fresh)
        except Exception as exc:  # reported, so every rank's outcome is seen
            error = f"{type(exc).__name__}: {exc}"
        expected = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in expected.items()}
        got = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in fresh.items()}
        exact = error is None and all(torch.equal(got[k], expected[k]) for k in expected)
        (out / f"{rank}.json").write_text(json.dumps({"step": step, "exact": exact, "error": error}))
    ck.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))

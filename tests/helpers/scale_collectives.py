"""Test helper (3+ gloo ranks, forked by procs.run_ranks; torchrun works too): what a save
exchanges and what a same-world restore opens.

    scale_collectives.py OUT ROOT

Saves step 1 of a mixed state (a Shard(0) DTensor, a Replicate() DTensor, a plain tensor equal on
every rank, a plain tensor of this rank's own) while recording every torch.distributed call
made during the save; then restores it into a zeroed state on the same ranks while recording
the files of the step each rank opens (audit hook on `open`) and which rows of the manifest's
shard table its parse built (format 3: `ShardTable.built`; None for a list of rows). Rank r
writes OUT/r.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import slurmresume

CALLS: list[str] = []
OPENS: list[str] = []
RECORDING = {"calls": False, "opens": False}


def _recorded(name: str, fn: object) -> object:
    def wrapper(*args: object, **kwargs: object) -> object:
        if RECORDING["calls"]:
            CALLS.append(name)
        return fn(*args, **kwargs)  # type: ignore[operator]

    return wrapper


for _name in ("all_gather", "all_gather_into_tensor", "all_gather_object", "gather", "gather_object", "broadcast",
              "broadcast_object_list", "all_reduce", "all_to_all", "scatter", "reduce"):
    setattr(dist, _name, _recorded(_name, getattr(dist, _name)))


def _audit(event: str, args: tuple) -> None:
    if event == "open" and RECORDING["opens"] and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if "step_000000001" in path:
            OPENS.append(os.path.basename(path))


def state(mesh: object, rank: int, step: int) -> dict:
    return {"w": distribute_tensor(torch.arange(48.0).reshape(12, 4) + step, mesh, [Shard(0)]),
            "rep": distribute_tensor(torch.arange(6.0) + step, mesh, [Replicate()]),
            "plain": torch.full((5,), float(step)), "mine": torch.full((3,), float(10 * rank + step))}


def main(argv: list[str]) -> int:
    out, root = Path(argv[0]), Path(argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    saved = state(mesh, rank, 1)
    RECORDING["calls"] = True
    ck.save(1, saved)
    RECORDING["calls"] = False
    fresh = {k: (v * 0 if isinstance(v, torch.Tensor) else v) for k, v in state(mesh, rank, 0).items()}
    sys.addaudithook(_audit)
    RECORDING["opens"] = True
    step = ck.restore(fresh)
    RECORDING["opens"] = False
    exact = all(torch.equal(fresh[k].full_tensor() if hasattr(fresh[k], "full_tensor") else fresh[k],
                            saved[k].full_tensor() if hasattr(saved[k], "full_tensor") else saved[k]) for k in saved)
    shards = ck.restored.manifest.shards if ck.restored and ck.restored.manifest else None
    built = sorted(shards.built) if hasattr(shards, "built") else None
    (out / f"{rank}.json").write_text(json.dumps({"calls": CALLS, "opens": OPENS, "step": step, "exact": exact,
                                                  "rows_built": built}))
    ck.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))

"""Test helper (gloo ranks, forked by procs.run_ranks): a resharding restore's opened files.

    reshard_opens.py save|restore OUT ROOT

save: step 1 of a state with DTensors whose pieces have one row (`row`: as many rows as ranks),
several rows (`w`) and columns (`col`, Shard(1)), a plain tensor and this rank's own.
restore (on another world size): into zeros, recording the files of the step each rank opens
(audit hook on `open`); rank r writes OUT/restore-W-r.json with them and whether every tensor is
exactly the saved one.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import slurmresume

SAVED_WORLD = 3
OPENS: list[str] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if "step_000000001" in path:
            OPENS.append(os.path.basename(path))


def full(step: int) -> dict[str, torch.Tensor]:
    return {"row": torch.arange(SAVED_WORLD * 6.0).reshape(SAVED_WORLD, 6) + step,
            "w": torch.arange(48.0).reshape(12, 4) + step, "col": torch.arange(36.0).reshape(3, 12) + step}


def state(mesh: object, step: int) -> dict:
    out: dict = {k: distribute_tensor(v, mesh, [Shard(1 if k == "col" else 0)]) for k, v in full(step).items()}
    out["plain"] = torch.full((5,), float(step))
    return out


def main(argv: list[str]) -> int:
    mode, out, root = argv[0], Path(argv[1]), Path(argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    if mode == "save":
        ck.save(1, state(mesh, 1))
    else:
        fresh = {k: v * 0 for k, v in state(mesh, 0).items()}
        sys.addaudithook(_audit)
        try:
            step = ck.restore(fresh, restore_rng=False, step=1)
        except slurmresume.CheckpointError as exc:  # the same error on every rank
            (out / f"restore-{world}-{rank}.json").write_text(json.dumps({"error": str(exc)}))
            return 0
        exact = all(torch.equal(fresh[k].full_tensor(), v) for k, v in full(1).items())
        exact = exact and torch.equal(fresh["plain"], torch.full((5,), 1.0))
        (out / f"restore-{world}-{rank}.json").write_text(json.dumps({"opens": OPENS, "step": step, "exact": exact}))
    ck.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

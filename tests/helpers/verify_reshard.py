"""Test helper (run under torch.distributed.run, gloo): a DTensor embedding saved on W ranks and
restored on W' ranks, for the verified-restore tests.

    verify_reshard.py save    ROOT        save steps 1 and 2 (embedding = step-dependent values)
    verify_reshard.py restore ROOT OUT    restore into a zero DTensor; rank r writes OUT/r.json
                                          with the restored step and the full tensor
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import slurmresume

SHAPE = (12, 8)


def values(step: int) -> torch.Tensor:
    return torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32).reshape(SHAPE) + 1000.0 * step


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mode, root = argv[0], Path(argv[1])
    ckpt = slurmresume.Checkpointer(root, handle_signals=False)
    if mode == "save":
        for step in (1, 2):
            ckpt.save(step, {"emb": distribute_tensor(values(step), mesh, [Shard(0)]), "step": step})
    else:
        state = {"emb": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)]), "step": -1}
        step = ckpt.restore(state)
        full = state["emb"].full_tensor()
        out = Path(argv[2])
        (out / f"{dist.get_rank()}.json").write_text(json.dumps(
            {"step": step, "value": state["step"], "equals": [s for s in (0, 1, 2) if torch.equal(full, values(s))]}))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Test helper (run under torch.distributed.run, gloo): a wide Shard(1) DTensor whose pieces are
over 16 MiB and a Shard(0) one, saved on W ranks and restored on W' ranks, for the read
amplification of resharded restores (#33).

    wide_reshard.py save    ROOT [late]   save step 1; with `late`, every piece takes the path a
                                          GPU piece takes (shard.on_device: its bytes reach host
                                          memory by a copy, after the plan of the header)
    wide_reshard.py restore ROOT OUT      restore into zeros; rank r writes OUT/wide-W'-r.json:
                                          data bytes read and needed (reshard.STATS), exactness
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import slurmresume
from slurmresume.checkpoint import reshard, shard

WIDE = (64, 225_000)  # float32, Shard(1): on 3 ranks a piece is 64 x 75,000 (18.3 MiB, over the old 16 MiB cap)


def full(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"wide": torch.randn(*WIDE, generator=g),
            "tall": torch.randn(3001, 257, generator=g).to(torch.bfloat16)}


def state(mesh: Any, seed: int | None) -> dict[str, Any]:
    values = full(seed) if seed is not None else {k: torch.zeros_like(v) for k, v in full(0).items()}
    return {"extra": {"wide": distribute_tensor(values["wide"], mesh, [Shard(1)]),
                      "tall": distribute_tensor(values["tall"], mesh, [Shard(0)])}}


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    mode, root = argv[0], Path(argv[1])
    ckpt = slurmresume.Checkpointer(root, handle_signals=False)
    if mode == "save":
        if argv[2:] == ["late"]:  # the GPU path, on CPU: bytes reach the host by a copy
            assert hasattr(shard, "on_device") and hasattr(shard, "to_host"), "no device-path seam"
            shard.on_device = lambda t: True
            shard.to_host = lambda t: t.detach().clone().contiguous()
        ckpt.save(1, state(mesh, 1))
    else:
        live = state(mesh, None)
        reshard.STATS.update(bytes=0, reads=0, needed=0)
        step = ckpt.restore(live)
        want = full(1)
        exact = {k: torch.equal(v.full_tensor(), want[k]) for k, v in live["extra"].items()}
        info = {"rank": rank, "step": step, "bytes": reshard.STATS["bytes"], "needed": reshard.STATS["needed"],
                "exact": exact}
        (Path(argv[2]) / f"wide-{world}-{rank}.json").write_text(json.dumps(info))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

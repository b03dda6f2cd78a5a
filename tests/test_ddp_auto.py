"""Issue #28: the Checkpointer finds the DDP wrapper it must record (`ddp.find_wrappers`): of the
model in state, or the wrapper itself; an explicit DDPBuckets turns the search off. Two gloo
ranks (DDP needs a process group of 2+ for the search to matter)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.multiprocessing as mp
from helpers.procs import free_port


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slurmresume import DDPBuckets
    from slurmresume.train.ddp import find_wrappers

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model, other = nn.Linear(3, 3), nn.Linear(2, 2)
    ddp = DDP(model)
    by_model = find_wrappers({"model": model, "other": other, "lr": 0.1})
    by_wrapper = find_wrappers({"net": ddp})
    explicit = find_wrappers({"model": model, "b": DDPBuckets(ddp)})
    if rank == 0:
        Path(out).write_text(json.dumps({"by_model": {k: v.ddp is ddp for k, v in by_model.items()},
                                         "by_wrapper": {k: v.ddp is ddp for k, v in by_wrapper.items()},
                                         "explicit": list(explicit)}))
    dist.destroy_process_group()


def test_the_wrapper_of_the_model_in_state_is_found(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(free_port(), str(tmp_path / "out.json")), nprocs=2, join=True)
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["by_model"] == {"model": True}
    assert got["by_wrapper"] == {"net": True}
    assert got["explicit"] == []

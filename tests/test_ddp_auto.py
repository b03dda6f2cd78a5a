"""Issue #28: the Checkpointer finds the DDP wrapper it must record (`ddp.find_wrappers`): of the
model in state, or the wrapper itself; an explicit DDPBuckets turns the search off. Two gloo
ranks (DDP needs a process group of 2+ for the search to matter)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
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


class _Holder:
    """A framework's state entry that is not a module (Lightning's checkpoint dict)."""

    def __init__(self, model: object) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return self.model.state_dict()  # type: ignore[attr-defined]

    def load_state_dict(self, sd: dict) -> None:
        self.model.load_state_dict(sd)  # type: ignore[attr-defined]


def _wrapped_after_restore(rank: int, port: int, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slurmresume import Checkpointer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=3)

    def build(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        m = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
        return m, torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)

    def train(ddp: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
        for s in steps:
            g = torch.Generator().manual_seed(1000 * rank + s)
            x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()

    def state(how: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
        return {"model": model, "optimizer": opt, "note": 0} if how == "module" else {"net": _Holder(model),
                                                                                      "optimizer": opt}

    got = {}
    for how in ("module", "track"):
        # the uninterrupted run: saves step 3 (the layout DDP rebuilt after its first backward), trains on
        model, opt = build(0)
        ddp = DDP(model)
        ck = Checkpointer(Path(root) / how, handle_signals=False)
        if how == "track":
            ck.track_ddp("net", ddp)
        train(ddp, opt, range(1, 4))
        ck.save(3, state(how, model, opt))
        train(ddp, opt, range(4, 8))
        ck.close()
        if how == "module":  # a run restored at its last step saves it again before any forward
            mid, mid_opt = build(2)
            ck_mid = Checkpointer(Path(root) / how, handle_signals=False)
            assert ck_mid.restore(mid_state := state(how, mid, mid_opt)) == 3
            mid_state["note"] = 1  # changed after the loop: the final save replaces step 3
            assert ck_mid.save(3, mid_state) is not None  # and still holds the layout
            ck_mid.close()
        # the resumed run: restore first, wrap afterwards (HF Trainer; a framework's own wrapper)
        model2, opt2 = build(1)
        ck2 = Checkpointer(Path(root) / how, handle_signals=False)
        assert ck2.restore(state(how, model2, opt2)) == 3
        ddp2 = DDP(model2)
        if how == "track":
            ck2.track_ddp("net", ddp2)
        train(ddp2, opt2, range(4, 8))
        ck2.close()
        got[how] = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True))
    if rank == 0:
        Path(out).write_text(json.dumps(got))
    dist.destroy_process_group()


@pytest.mark.slow  # 3 ranks, five Checkpointers: 84-186 s on the loaded shared machine
def test_a_wrapper_created_after_restore_gets_the_saved_layout(tmp_path: Path) -> None:
    """3 ranks (2 hide the layout: a+b == b+a). Restore, then wrap the model in state (found at
    the wrapper's first forward), or hand a wrapper of a non-module entry over with track_ddp:
    the resumed steps equal the uninterrupted run's bitwise, also after a run that restored and
    saved the step again before any forward. Old code: the layout stayed pending nowhere, the
    resumed run reduced with DDP's initial layout and differed."""
    mp.spawn(_wrapped_after_restore, args=(free_port(), str(tmp_path), str(tmp_path / "out.json")), nprocs=3,
             join=True)
    assert json.loads((tmp_path / "out.json").read_text()) == {"module": True, "track": True}

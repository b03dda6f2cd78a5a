"""Test helper (run as gloo ranks: under torch.distributed.run, or forked by helpers/forkranks.py
as tests/test_node_layout.py runs it): the per-node layout (`nodefile`) with the
node size emulated by NODE_SIZE (LOCAL_WORLD_SIZE and LOCAL_RANK for the save: 4 ranks as 2
nodes of 2).

    node_layout.py save    ROOT STEPS       save the given steps (comma separated), per-node layout
    node_layout.py restore ROOT OUT         restore; rank r writes OUT/r.json: the restored step and
                                            which saved step each tensor equals, bit for bit
    node_layout.py cycle   ROOT OUT         one process, Checkpointer after Checkpointer: the first
                                            saves steps 1 and 2, each of the next four one more step
                                            (3..6), closing in between (with the one of step 3 a
                                            second one is open, saving step 3 asynchronously to
                                            ROOT-twin); then another restores as above
A rank named by KILL_RANK gets SLURMRESUME_TEST_KILL_AT=KILL_AT (it dies there, mid-write), one
named by FAIL_RANK SLURMRESUME_TEST_FAIL_AT=FAIL_AT (an injected I/O error there);
BIG_MIB adds a per-rank float tensor of that many MiB to the saved state.

The state: a DTensor of 13 x 8 rows sharded over the ranks (uneven pieces), a replicated bf16
tensor, and an int. Values depend on the step, so a restore says which step it found.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

for _act in ("KILL", "FAIL"):
    if os.environ.get(f"{_act}_RANK") is not None and os.environ.get(f"{_act}_RANK") == os.environ.get("RANK"):
        os.environ[f"SLURMRESUME_TEST_{_act}_AT"] = os.environ[f"{_act}_AT"]
if os.environ.get("NODE_SIZE"):  # torchrun's variables as on nodes of NODE_SIZE ranks
    os.environ["LOCAL_WORLD_SIZE"] = os.environ["NODE_SIZE"]
    os.environ["LOCAL_RANK"] = str(int(os.environ["RANK"]) % int(os.environ["NODE_SIZE"]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Shard, distribute_tensor  # noqa: E402

import slurmresume  # noqa: E402

SHAPE = (13, 8)


def emb(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(SHAPE, generator=g)


def bias(step: int) -> torch.Tensor:
    return (torch.arange(1000, dtype=torch.float32) * (step + 0.5)).to(torch.bfloat16)


def save(ckpt: slurmresume.Checkpointer, mesh: object, step: int) -> None:
    state = {"emb": distribute_tensor(emb(step), mesh, [Shard(0)]), "bias": bias(step), "step": step}
    if os.environ.get("BIG_MIB"):  # a per-rank tensor: several writes per rank (the kill test)
        state["big"] = torch.full((int(os.environ["BIG_MIB"]) << 18,), float(dist.get_rank()))
    ckpt.save(step, state)


def restore(ckpt: slurmresume.Checkpointer, mesh: object, out: Path) -> None:
    state = {"emb": distribute_tensor(torch.zeros(SHAPE), mesh, [Shard(0)]),
             "bias": torch.zeros(1000, dtype=torch.bfloat16), "step": -1}
    step = ckpt.restore(state)
    full = state["emb"].full_tensor()
    (out / f"{dist.get_rank()}.json").write_text(json.dumps({
        "step": step, "value": state["step"],
        "emb": [s for s in range(8) if torch.equal(full, emb(s))],
        "bias": [s for s in range(8) if torch.equal(state["bias"], bias(s))]}))


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mode, root = argv[0], Path(argv[1])
    ckpt = slurmresume.Checkpointer(root, handle_signals=False)
    if mode == "save":
        for step in (int(s) for s in argv[2].split(",")):
            save(ckpt, mesh, step)
    elif mode == "cycle":
        save(ckpt, mesh, 1)
        save(ckpt, mesh, 2)
        for step in range(3, 7):
            ckpt.close()
            ckpt = slurmresume.Checkpointer(root, handle_signals=False)
            if step == 3:  # a second Checkpointer open beside it, saving asynchronously to ROOT-twin
                twin = slurmresume.Checkpointer(f"{root}-twin", handle_signals=False, async_save=True)
                save(twin, mesh, step)
            save(ckpt, mesh, step)
            if step == 3:
                twin.close()
        ckpt.close()
        ckpt = slurmresume.Checkpointer(root, handle_signals=False)
        restore(ckpt, mesh, Path(argv[2]))
    else:
        restore(ckpt, mesh, Path(argv[2]))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

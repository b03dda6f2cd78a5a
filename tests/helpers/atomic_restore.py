"""Test helper (gloo ranks, forked by procs.run_ranks; torchrun works too): FSDP2 state with uneven
shapes and mixed dtypes, saved on W ranks and restored on W' ranks, for the all-or-nothing restore tests (#33).

    atomic_restore.py save    ROOT OUT    save step 1 (model, AdamW after one step, extra DTensors);
                                          rank 0 writes OUT/full.safetensors (every tensor, whole)
    atomic_restore.py refuse  ROOT OUT    restore into other values; rank r writes OUT/refuse-r.json:
                                          the error (or the step), and every tensor, module and
                                          optimizer entry that differs from before the call
    atomic_restore.py bytes   ROOT OUT    restore; rank r writes OUT/bytes-W'-r.json: data bytes read
                                          and needed (reshard.STATS), and whether the state is exact
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import slurmresume
from slurmresume.checkpoint import reshard


def build(mesh: Any, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.LayerNorm(37), torch.nn.Tanh(),
                                torch.nn.Linear(37, 11))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(5, 13)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    g = torch.Generator().manual_seed(seed)
    extra = {  # uneven shapes, mixed dtypes, one sharded along dim 1
        "a": distribute_tensor(torch.randn(29, 7, generator=g).to(torch.bfloat16), mesh, [Shard(0)]),
        "b": distribute_tensor(torch.randint(0, 1 << 40, (41,), generator=g), mesh, [Shard(0)]),
        "c": distribute_tensor(torch.randn(17, 5, 3, generator=g).to(torch.float16), mesh, [Shard(0)]),
        "d": distribute_tensor(torch.randn(23, 9, generator=g, dtype=torch.float64), mesh, [Shard(0)]),
        "e": distribute_tensor(torch.randn(6, 31, generator=g), mesh, [Shard(1)]),
        "f": distribute_tensor(torch.randn(1000, 24, generator=g), mesh, [Shard(0)]),  # stripes of several rows
    }
    return {"model": model, "optim": opt, "extra": extra,
            "plain": torch.randn(19, generator=g), "step": seed}


def tensors(state: dict[str, Any], whole: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor in `state` as this rank holds it (DTensors: the local piece, or with `whole`
    the full tensor, collective), by path."""
    out: dict[str, torch.Tensor] = {}

    def walk(path: str, v: Any) -> None:
        if isinstance(v, DTensor):
            out[path] = v.full_tensor() if whole else v.to_local()
        elif isinstance(v, torch.Tensor):
            out[path] = v
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(f"{path}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for k, x in enumerate(v):
                walk(f"{path}/{k}", x)

    walk("model", state["model"].state_dict())
    walk("optim", state["optim"].state_dict())
    walk("extra", state["extra"])
    walk("plain", state["plain"])
    return out


def snapshot(state: dict[str, Any]) -> dict[str, bytes]:
    raw = {k: t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
           for k, t in tensors(state).items()}
    raw["optim/param_groups"] = repr(state["optim"].state_dict()["param_groups"]).encode()
    return raw


def main(argv: list[str]) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    mode, root = argv[0], Path(argv[1])
    ckpt = slurmresume.Checkpointer(root, handle_signals=False)
    if mode == "save":
        state = build(mesh, 1)
        ckpt.save(1, state)
        full = {k: v.contiguous() for k, v in tensors(state, whole=True).items()}
        if rank == 0:
            save_file(full, str(Path(argv[2]) / "full.safetensors"))
    elif mode == "refuse":
        state = build(mesh, 7)
        before, objects = snapshot(state), {k: id(v) for k, v in state.items()}
        try:
            result: dict[str, Any] = {"step": ckpt.restore(state)}
        except slurmresume.CheckpointError as exc:
            result = {"error": str(exc)}
        after = snapshot(state)
        result["changed"] = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        result["replaced"] = sorted(k for k, v in state.items() if objects.get(k) != id(v))
        result["step_value"] = state["step"]
        (Path(argv[2]) / f"refuse-{rank}.json").write_text(json.dumps(result))
    else:
        state = build(mesh, 7)
        reshard.STATS.update(bytes=0, reads=0, needed=0)
        step = ckpt.restore(state)
        got, saved = tensors(state, whole=True), load_file(str(Path(argv[2]) / "full.safetensors"))
        mismatch = sorted(k for k in saved.keys() | got.keys()
                          if k not in got or k not in saved or not torch.equal(saved[k], got[k]))
        info = {"rank": rank, "step": step, "bytes": reshard.STATS["bytes"], "needed": reshard.STATS["needed"],
                "mismatch": mismatch}
        (Path(argv[2]) / f"bytes-{world}-{rank}.json").write_text(json.dumps(info))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

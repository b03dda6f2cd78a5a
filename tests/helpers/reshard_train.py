"""A tiny FSDP2 training run on CPU/gloo for the resharding tests (gloo ranks, forked by
procs.run_ranks; torchrun works too).

    reshard_train.py save   OUT ROOT            train 3 steps on W ranks (Shard(0)), save step 3,
                                                write OUT/full.safetensors (the full state)
    reshard_train.py resume OUT ROOT --dim D    restore on W' ranks with FSDP2 sharding dim D,
                                                check the restored full tensors against the saved
                                                ones, continue 3 steps; then do the same 3 steps
                                                from a reference load (distribute_tensor of the
                                                saved full state) and record both loss lists;
                                                --save-to R2 also saves the restored state to R2
    reshard_train.py bytes  OUT ROOT --dim D    save (4 ranks) or restore (other world sizes)
                                                plain DTensors, recording bytes read per rank

Every rank trains on the same full batch, so the loss is the same on every rank.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import slurmresume
from slurmresume.checkpoint import reshard


def build(mesh: object, dim: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 8))
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: Shard(dim if p.ndim > dim else 0))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, first: int, steps: int) -> list[str]:
    losses = []
    for step in range(first, first + steps):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item().hex())
    return losses


def full_state(model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.full_tensor() for k, v in model.state_dict().items()}
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"optim/{pid}/{k}"] = v.full_tensor() if isinstance(v, DTensor) else v.clone()
    out.update({f"extra/{k}": v.full_tensor() for k, v in extra.items()})
    return out


def extras(mesh: object, dim: int) -> dict:
    # identical pieces at different offsets (must not be taken for replicas) and a replicated one
    return {"ones": distribute_tensor(torch.ones(8, 4), mesh, [Shard(dim)]),
            "rep": distribute_tensor(torch.arange(6.0), mesh, [Replicate()])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode")
    ap.add_argument("out", type=Path)
    ap.add_argument("root", type=Path)
    ap.add_argument("--dim", type=int, default=0)
    ap.add_argument("--save-to", type=Path, help="resume: also save the restored state (this sharding) here")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ck = slurmresume.Checkpointer(args.root, handle_signals=False)
    if args.mode == "bytes":
        return bytes_mode(args, ck, mesh, rank, world)
    if args.mode == "save":
        model, opt = build(mesh, args.dim, seed=0)
        extra = extras(mesh, args.dim)
        train(model, opt, 0, 3)
        ck.save(3, {"model": model, "optim": opt, "extra": extra})
        full = full_state(model, opt, extra)
        if rank == 0:
            save_file(full, str(args.out / "full.safetensors"))
        ck.close()
        return
    model, opt = build(mesh, args.dim, seed=1)  # other weights: the restore must overwrite them
    state = {"model": model, "optim": opt, "extra": extras(mesh, args.dim)}
    reshard.STATS.update(bytes=0, reads=0)
    step = ck.restore(state)
    saved = load_file(str(args.out / "full.safetensors"))
    restored = full_state(model, opt, state["extra"])
    mismatch = sorted(k for k in saved if k not in restored or not torch.equal(saved[k], restored[k]))
    placements = sorted({str(p.placements) for p in model.parameters()})
    if args.save_to:
        with slurmresume.Checkpointer(args.save_to, handle_signals=False) as again:
            again.save(step, state)
    losses = train(model, opt, step, 3)
    ref_model, ref_opt = build(mesh, args.dim, seed=2)
    ref_model.load_state_dict({k: distribute_tensor(saved[f"model/{k}"], mesh, v.placements)
                               for k, v in ref_model.state_dict().items()})
    params = list(ref_model.parameters())
    ref_opt.load_state_dict({"param_groups": ref_opt.state_dict()["param_groups"], "state": {
        i: {k: saved[f"optim/{i}/{k}"] if k == "step" else
            distribute_tensor(saved[f"optim/{i}/{k}"], mesh, p.placements) for k in ("step", "exp_avg", "exp_avg_sq")}
        for i, p in enumerate(params)}})
    ref_losses = train(ref_model, ref_opt, step, 3)
    result = {"rank": rank, "world": world, "step": step, "mismatch": mismatch, "losses": losses,
              "ref_losses": ref_losses, "placements": placements, "bytes": reshard.STATS["bytes"],
              "extra_type": type(state["extra"]["ones"]).__name__}
    (args.out / f"resume-{world}-{args.dim}-{rank}.json").write_text(json.dumps(result))
    ck.close()


def bytes_mode(args: argparse.Namespace, ck: slurmresume.Checkpointer, mesh: object, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(0)
    full = {f"w{i}": torch.randn(256, 512, generator=gen) for i in range(4)}  # 4 x 512 KiB
    state = {"w": {k: distribute_tensor(v if world == 4 else torch.zeros_like(v), mesh, [Shard(args.dim)])
                   for k, v in full.items()}}
    if world == 4:
        ck.save(1, state)
    else:
        reshard.STATS.update(bytes=0, reads=0)
        ck.restore(state)
        ok = all(torch.equal(state["w"][k].full_tensor(), v) for k, v in full.items())
        info = {"rank": rank, "bytes": reshard.STATS["bytes"], "reads": reshard.STATS["reads"], "ok": ok,
                "total": sum(v.numel() * 4 for v in full.values())}
        (args.out / f"bytes-{world}-{args.dim}-{rank}.json").write_text(json.dumps(info))
    ck.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()

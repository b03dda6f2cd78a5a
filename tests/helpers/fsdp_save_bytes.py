"""Test helper (8 gloo ranks, forked by procs.run_ranks): the bytes a non-zero rank receives in a
real FSDP2 + torch.optim.Adam save, to set beside scripts/bench_scale.py's count (issue #50).

    fsdp_save_bytes.py OUT ROOT

The model has the parameters of bench_scale's "tiny" model (model_shapes.parameters), sharded by
`fully_shard` on a CPU mesh over every rank; Adam takes two steps (every rank seeded alike, as a
data-parallel run is: its RNG state is the same everywhere). `Checkpointer.save` of step 50 (it
makes the side group), then the measured save of step 100 (bench_scale's STEP), recording every
collective call on this rank and what it receives by `bench_scale.received_bytes` (gloo's
algorithms, tensor bytes), and, from the kernel (`ss -tin`: TCP_INFO bytes_received of this
process's sockets, the rendezvous store's left out), the bytes that really arrived (tensor bytes
plus gloo's and TCP's framing). Rank r writes OUT/r.json.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_scale import STEP, received_bytes  # noqa: E402
from model_shapes import parameters  # noqa: E402

import slurmresume  # noqa: E402

CALLS: list[list] = []
RECORDING = {"on": False}


def _recorded(kind: str, fn: object) -> object:
    def wrapper(*args: object, **kwargs: object) -> object:
        if RECORDING["on"]:
            tensor = args[1] if kind == "all_gather" else args[0]
            n = tensor.numel() * tensor.element_size()  # type: ignore[attr-defined]
            CALLS.append([kind, n, received_bytes(kind, n, dist.get_world_size(), dist.get_rank() == 0)])
        return fn(*args, **kwargs)  # type: ignore[operator]

    return wrapper


for _kind in ("all_gather", "gather", "broadcast", "all_reduce"):
    setattr(dist, _kind, _recorded(_kind, getattr(dist, _kind)))


class Tiny(torch.nn.Module):
    """bench_scale's "tiny" model's parameters (names with '.' as '_': a module attribute's)."""

    def __init__(self) -> None:
        super().__init__()
        for name, shape in parameters("tiny"):
            self.register_parameter(name.replace(".", "_"), torch.nn.Parameter(torch.randn(shape) * 0.02))

    def forward(self) -> torch.Tensor:
        return sum((p.float() ** 2).mean() for p in self.parameters())  # type: ignore[return-value]


def wire_received(store_port: int) -> int | None:
    """TCP bytes received so far by this process's sockets, the rendezvous store's excepted
    (None without iproute2's `ss`)."""
    if shutil.which("ss") is None:
        return None
    text = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout.splitlines()
    total, mine = 0, f"pid={os.getpid()},"
    for head, info in zip(text[::2], text[1::2]):
        cols = head.split()
        if mine not in head or any(c.endswith(f":{store_port}") for c in cols[3:5]):
            continue
        m = re.search(r"bytes_received:(\d+)", info)
        total += int(m.group(1)) if m else 0
    return total


def everyone_here(key: str) -> None:
    """A barrier through the rendezvous store (its bytes are not counted by `wire_received`)."""
    store = dist.distributed_c10d._get_default_store()
    store.add(key, 1)
    while int(store.add(key, 0)) < dist.get_world_size():
        time.sleep(0.01)


def main(argv: list[str]) -> int:
    out, root = Path(argv[0]), Path(argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = Tiny()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        model().backward()
        opt.step()
        opt.zero_grad()
    state = {"model": model, "optim": opt}
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    ck.save(50, state)  # the side group is made (and connected) by the first save
    port = int(os.environ["MASTER_PORT"])
    everyone_here("before")
    before = wire_received(port)
    everyone_here("measure")
    RECORDING["on"] = True
    ck.save(STEP, state)
    RECORDING["on"] = False
    after = wire_received(port)  # this rank has received all its save's bytes when save returns
    wire = after - before if after is not None and before is not None else None
    plain = [k for st in opt.state_dict()["state"].values() for k, v in st.items()
             if isinstance(v, torch.Tensor) and not hasattr(v, "placements")]
    (out / f"{rank}.json").write_text(json.dumps({"calls": CALLS, "received": sum(c[2] for c in CALLS),
                                                  "wire_received": wire, "plain_steps": len(plain)}))
    everyone_here("done")
    ck.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The fake world the scale benches stand in, and what they count in it: bench_scale.py measures
ours, bench_scale_dcp.py measures torch.distributed.checkpoint the same way, so both take these
from here (and neither imports the other's measuring).

- `fake_world`: this process as one rank of W on torch's fake backend (a 1-D CPU DeviceMesh).
- `Ops`: metadata operations, counted at the os seam and checkpoint.fsio's fsync labels.
- `moments_state`: the state the harness measured before issue #50 (every parameter and both
  Adam moments as Shard(0) DTensors), which bench_scale_dcp still measures DCP on.
- `mib`: a byte count as the benches print it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from model_shapes import chunk0, parameters

from slurmresume.checkpoint import fsio

# -- the fake world -----------------------------------------------------------------------------

def fake_world(world: int, rank: int = 0) -> Any:
    """This process as `rank` of `world` on the fake backend; returns the 1-D CPU DeviceMesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    return init_device_mesh("cpu", (world,))


# -- counting metadata operations ---------------------------------------------------------------

class Ops:
    """Metadata operations, counted where they happen: the os functions every path goes through,
    and checkpoint.fsio's fsync labels (a file's fsync vs a directory's). fsync is not performed."""

    KINDS = {"stat": "stat", "lstat": "stat", "mkdir": "mkdir", "rename": "rename",
             "replace": "rename", "unlink": "unlink", "rmdir": "unlink", "scandir": "list", "listdir": "list"}

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    @contextlib.contextmanager
    def counting(self) -> Iterator[Counter[str]]:
        self.counts = Counter()
        saved: dict[tuple[Any, str], Any] = {}

        def wrap(owner: Any, name: str, kind: Callable[..., str]) -> None:
            real = getattr(owner, name)
            saved[(owner, name)] = real

            def counted(*a: Any, **k: Any) -> Any:
                self.counts[kind(*a, **k)] += 1
                return real(*a, **k)
            setattr(owner, name, counted)

        # each os function wrapped once (os.open below, not in KINDS): a second wrap would be
        # restored to the first wrapper and stay, counting every later call twice
        for name, kind in self.KINDS.items():
            wrap(os, name, lambda *a, _k=kind, **k: _k)
        wrap(os, "open", lambda path, flags, *a, **k: "create" if flags & os.O_CREAT else "open")
        real_fsync_fd, real_fsync_dir = fsio.fsync_fd, fsio.fsync_dir
        saved[(fsio, "fsync_fd")], saved[(fsio, "fsync_dir")] = real_fsync_fd, real_fsync_dir
        fsio.fsync_fd = lambda fd, label, path="": self.counts.update(["fsync"])  # type: ignore[assignment]
        fsio.fsync_dir = lambda path, label: self.counts.update(["fsyncdir"])  # type: ignore[assignment]
        try:
            yield self.counts
        finally:
            for (owner, name), real in saved.items():
                setattr(owner, name, real)

    @staticmethod
    def total(counts: Counter[str]) -> int:
        return sum(counts.values())


# -- one rank's state before issue #50 ---------------------------------------------------------

def moments_state(model: str, mesh: Any, world: int, rank: int, zeros: bool = False) -> dict[str, Any]:
    """The state the harness measured before issue #50 (bench_scale_dcp still measures DCP on it):
    every parameter and both Adam moments as Shard(0) DTensors, no plain tensor."""
    from torch.distributed.tensor import DTensor, Shard

    state: dict[str, dict[str, Any]] = {m: {} for m in ("param", "exp_avg", "exp_avg_sq")}
    for pname, shape in parameters(model):
        _, rows = chunk0(shape[0], world, rank)
        local = (rows, *shape[1:])
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        for m in state:
            t = torch.zeros(local) if zeros else torch.zeros(1).expand(local)
            state[m][pname] = DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                                 stride=stride)
    return state


def mib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**20:.2f} MiB"

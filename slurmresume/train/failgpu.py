"""The failure-time save with the state on GPUs (issue 47, item 4): the survivors of a dead rank are
stuck in an NCCL collective that will never finish, and the replicated tensors the writer saves
live on its GPU. Two steps, both on the failure-save thread, never on the training thread:

  1. `release`: abort this rank's NCCL communicators (`_abort_process_group`), so that the hung
     kernel and every host wait on it end with an error instead of waiting forever (gloo needs
     nothing: the dead peer's socket is closed and the collective already raised);
  2. `to_host`: copy the tensors to CPU on a side stream of their device. The parameters and the
     optimizer state of the boundary are not written by any kernel queued after the hung
     collective before the optimizer step (which the frozen rank never reaches), so the side
     stream does not wait for the blocked compute stream.

Only the small per-rank state is snapshotted at each step (`stepsnap`; CUDA RNG states are host
copies). Checked on a GPU by tests/test_failgpu.py when one is lent; on CPU, these are no-ops.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("slurmresume")


def on_gpu(tensors: list[tuple[str, Any]]) -> bool:
    return any(t.device.type == "cuda" for _, t in tensors)


def release(pg: Any) -> str | None:
    """Abort the NCCL communicators of `pg` (None: the default group); returns what went wrong,
    or None. A gloo group is left alone."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        if dist.get_backend(pg) != "nccl":
            return None
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group(pg) if pg is not None else _abort_process_group()
        return None
    except Exception as exc:  # noqa: BLE001 - a failed abort is reported; the copy may still work
        log.warning("failure save: could not abort the NCCL communicator: %s", exc)
        return f"{type(exc).__name__}: {exc}"


def to_host(tensors: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Every tensor on the CPU, GPU ones copied on a side stream of their device (see above)."""
    import torch

    out: list[tuple[str, Any]] = []
    streams: dict[Any, Any] = {}
    for name, t in tensors:
        if t.device.type != "cuda":
            out.append((name, t))
            continue
        stream = streams.setdefault(t.device, torch.cuda.Stream(device=t.device))  # type: ignore[no-untyped-call]
        with torch.cuda.stream(stream):
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t.detach(), non_blocking=True)
        out.append((name, host))
    for stream in streams.values():
        stream.synchronize()
    return out

"""DDP's gradient-bucket layout as part of the state, so a resumed run reduces like the
uninterrupted one.

DDP starts a process with one layout (all parameters in one bucket unless
`find_unused_parameters`), records the order in which gradients become ready during the first
backward, and rebuilds its buckets in that order before the second forward. A resumed process
starts over with the initial layout, so its first step reduces gradients in other buckets than
the uninterrupted run did at that step. With 3+ ranks the ring all-reduce splits each bucket into
chunks and the floating-point sums round differently per chunk boundary: the resumed run drifts
(2 ranks hide it, since a+b == b+a). `DDPBuckets` saves what the rebuild decided and, on restore,
rebuilds the reducer with that assignment before the first resumed step.

Automatic: `Checkpointer` finds the DDP wrapper of each module in `state` (the wrapper itself, or
the model it wraps: `find_wrappers`) and keeps their layouts as library-owned state ("ddp"), so a
script that follows the README needs no line for it. A wrapper created after `restore` (HF Trainer,
Lightning's strategy) is handled by `ddptrack`.
An explicit entry is the override, and turns the automatic one off for the whole state:

    state["ddp_buckets"] = slurmresume.DDPBuckets(ddp_model)                 # the same, by hand
    state["ddp_buckets"] = slurmresume.DDPBuckets(ddp_model, enabled=False)  # never restore a layout

Not restored (a warning says so, and the resumed run may differ in the last bits on 3+ ranks):
a communication hook registered before the restore (register it after `ckpt.restore`), and
`static_graph=True` or mixed precision, whose reducers carry more state than the layout.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

log = logging.getLogger("slurmresume")


def parse_layout(raw: Any) -> list[list[int]] | None:
    """A bucket assignment as DDP's logging data writes it ("5 4 3 2, 1 0" -> [[5, 4, 3, 2],
    [1, 0]]); None for an empty one. ValueError when malformed."""
    if not isinstance(raw, str) or not raw.strip():
        return None
    return [[int(i) for i in bucket.split()] for bucket in raw.split(",")]


def check_layout(buckets: Any, n_params: int) -> list[list[int]]:
    """A saved layout must assign each of this model's `n_params` parameters exactly once."""
    if not (isinstance(buckets, list) and all(isinstance(b, list) and b for b in buckets)):
        raise ValueError("the saved DDP bucket layout is not a list of non-empty lists")
    flat = [i for b in buckets for i in b]
    if sorted(flat) != list(range(n_params)) or not all(isinstance(i, int) for i in flat):
        raise ValueError(f"the saved DDP bucket layout does not cover this model's {n_params} parameters once each")
    return buckets


class DDPBuckets:
    """A stateful view of a `DistributedDataParallel` module's bucket layout (see module doc).
    Its `state_dict()` is collective when the rebuild has not happened yet but gradients of one
    iteration were recorded: it asks the reducer to rebuild now (what the next forward would do),
    so even a save after the first step carries the layout."""

    def __init__(self, ddp: Any, *, enabled: bool = True) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp, DistributedDataParallel):
            raise TypeError(f"DDPBuckets wraps a DistributedDataParallel module, got {type(ddp).__name__}")
        self.ddp = ddp
        self.enabled = enabled  # False: saves nothing, restores nothing (a control, or an opt-out)
        self._restored = ""  # the layout restore pinned, saved again until DDP's own rebuild shows

    def state_dict(self) -> dict[str, Any]:
        # kept as DDP's own string: a scalar, so a live state that has no layout yet still "fits"
        return {"buckets": (self.layout() or self._restored or "") if self.enabled else ""}

    def layout(self) -> str:
        """What DDP's rebuild decided, or None before its first backward. DDP's logging data
        shows it only from the iteration after the rebuild: refresh it first."""
        ddp = self.ddp
        if _can_rebuild(ddp) and ddp.reducer._rebuild_buckets():  # what the next forward would do
            ddp._has_rebuilt_buckets = True
        if getattr(ddp, "_has_rebuilt_buckets", False) and ddp.logger is not None:
            ddp.logger.set_runtime_stats_and_log()
        return str(ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices") or "")

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = (state.get("buckets") or "") if self.enabled else ""
        try:
            buckets = parse_layout(saved)
        except ValueError:
            raise ValueError(f"the saved DDP bucket layout {str(saved)[:80]!r} is malformed") from None
        if buckets is None:
            return  # saved before DDP's first backward: the initial layout is the right one
        why = _unsupported(self.ddp)
        if why:
            log.warning("DDP bucket layout not restored (%s): with 3+ ranks the first resumed step may "
                        "differ from an uninterrupted run in the last bits", why)
            return
        params, expect_sparse = self.ddp._build_params_for_reducer()
        rebuild_reducer(self.ddp, check_layout(buckets, len(params)), params, expect_sparse)
        self._restored = saved


def find_wrappers(state: Mapping[str, Any]) -> dict[str, DDPBuckets]:
    """Every rank, once per Checkpointer: {state key: DDPBuckets} for each top-level entry that is
    a DistributedDataParallel module or the module one wraps. Empty without an initialised process
    group of 2+ ranks, and when `state` holds an explicit DDPBuckets (the override)."""
    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is None or not dist_mod.is_available() or not dist_mod.is_initialized():
        return {}
    if dist_mod.get_world_size() < 2:
        return {}
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    if any(isinstance(v, DDPBuckets) for v in state.values()):
        return {}
    direct = {k: v for k, v in state.items() if isinstance(v, DDP)}
    inner = {id(v): k for k, v in state.items() if isinstance(v, nn.Module) and not isinstance(v, DDP)}
    found: dict[str, Any] = dict(direct)
    if inner:
        # DDP keeps no registry of its instances: one pass over the tracked objects, at restore
        # (type(), not isinstance: a proxy's __class__ property could run code or warn)
        import gc

        for obj in gc.get_objects():
            if issubclass(type(obj), DDP) and id(obj.module) in inner and inner[id(obj.module)] not in found:
                found[inner[id(obj.module)]] = obj
    return {k: DDPBuckets(v) for k, v in sorted(found.items())}


def capture(buckets: Mapping[str, DDPBuckets]) -> dict[str, str]:
    """Every rank (collective when a rebuild is pending, see DDPBuckets): the library's "ddp" entry."""
    return {k: b.state_dict()["buckets"] for k, b in buckets.items()}


def restore(buckets: Mapping[str, DDPBuckets], saved: Any) -> None:
    """Every rank: pin each saved layout on the wrapper found for the same state key (one saved
    without a wrapper now, or the other way round, is left at DDP's initial layout)."""
    if not isinstance(saved, dict):
        return
    for key, layout in saved.items():
        if key in buckets and isinstance(layout, str):
            buckets[key].load_state_dict({"buckets": layout})


def rebuild_pending(buckets: Mapping[str, Any]) -> bool:
    """Whether capturing these layouts now would be collective (a wrapper's rebuild is pending)."""
    return any(_can_rebuild(b.ddp) for b in buckets.values() if isinstance(b, DDPBuckets))


def _can_rebuild(ddp: Any) -> bool:
    import torch

    return torch.is_grad_enabled() and not getattr(ddp, "_has_rebuilt_buckets", True)


def _unsupported(ddp: Any) -> str:
    data = ddp._get_ddp_logging_data()
    if data.get("comm_hook"):
        return f"a communication hook ({data['comm_hook']}) is registered; register it after ckpt.restore()"
    if getattr(ddp, "static_graph", False):
        return "static_graph=True"
    if getattr(ddp, "mixed_precision", None) is not None:
        return "mixed precision"
    if getattr(ddp, "_use_python_reducer", False):
        return "the Python reducer"
    return ""


def rebuild_reducer(ddp: Any, buckets: list[list[int]], params: list[Any], expect_sparse: list[bool]) -> None:
    """Replace `ddp.reducer` by one built with `buckets` (in the order the rebuild produced), the
    way DDP's own constructor builds it (`_ddp_init_helper`), with the bucket assignment pinned."""
    import torch.distributed as dist

    def pinned(*_: Any, **__: Any) -> tuple[list[list[int]], list[int]]:
        # _ddp_init_helper reverses what this returns (it expects definition order)
        return list(reversed(buckets)), [sys.maxsize] * len(buckets)

    ddp.reducer._remove_autograd_hooks()
    original = dist._compute_bucket_assignment_by_size  # type: ignore[attr-defined]
    dist._compute_bucket_assignment_by_size = pinned  # type: ignore[attr-defined]
    try:
        ddp._ddp_init_helper(params, expect_sparse, ddp._build_debug_param_to_name_mapping(params),
                             getattr(ddp, "static_graph", False))
    finally:
        dist._compute_bucket_assignment_by_size = original  # type: ignore[attr-defined]
    ddp._has_rebuilt_buckets = False

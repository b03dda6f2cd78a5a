"""Which DDP wrappers one Checkpointer records, also when a wrapper is created after `restore()`.

A script that wraps before `ckpt.restore` is found there (`ddp.find_wrappers`). Frameworks wrap
later: Lightning's `strategy="ddp"` and HF Trainer (through accelerate) build the DDP module after
the restore hook ran, and a script may restore the model and wrap it afterwards. A restored layout
must be pinned before the wrapper's first backward (DDP records and rebuilds its buckets there),
so the tracker keeps it `pending` and:
- catches the first forward of a DDP module that wraps a module in `state` (a global forward
  pre-hook, installed at restore only while some module in `state` has no wrapper, removed at the
  first step boundary), and pins the layout on it: HF Trainer and restore-then-wrap scripts;
- takes a wrapper handed over by an integration (`Checkpointer.track_ddp`: Lightning's
  `trainer.strategy.model`, whose state entry is Lightning's checkpoint, not the module).
Either way the wrapper's layout is saved from then on. A layout still pending at the first step
boundary was not applied: warned once (with 3+ ranks that step may differ in the last bits).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

from .ddp import DDPBuckets, find_wrappers

log = logging.getLogger("slurmresume")


class DDPTracker:
    """{state key: DDPBuckets} found so far (`found`; None before the first search), and the
    restored layouts whose wrapper does not exist yet (`pending`)."""

    def __init__(self) -> None:
        self.found: dict[str, DDPBuckets] | None = None
        self.pending: dict[str, str] = {}
        self._modules: dict[int, str] = {}  # id(module in state) -> its key, while watching
        self._hook: Any = None

    def search(self, state: Mapping[str, Any]) -> dict[str, DDPBuckets]:
        """Every rank: the wrappers that exist now (at restore, or at a first save without one)."""
        self.found = find_wrappers(state)
        return self.found

    def for_save(self) -> dict[str, Any]:
        """What a save records: each wrapper's layout, and a restored one still pending as it was
        (a run restored at its last step saves again before any forward)."""
        return {**{k: _Pinned(v) for k, v in self.pending.items()}, **(self.found or {})}

    def restore(self, saved: Any) -> None:
        """Every rank, inside the verified load: pin each saved layout on its wrapper, keep the
        others for a wrapper created later."""
        from .ddp import restore

        found = self.found or {}
        restore(found, saved)
        if isinstance(saved, dict):
            self.pending = {k: v for k, v in saved.items() if k not in found and isinstance(v, str) and v}

    def watch(self, state: Mapping[str, Any]) -> None:
        """Every rank, after restore: until the first step boundary, adopt the first DDP module
        whose forward runs and which wraps a module of `state` that has no wrapper yet."""
        if not _distributed() or any(isinstance(v, DDPBuckets) for v in state.values()):
            return  # one process, or the explicit override
        import torch.nn as nn
        from torch.nn.parallel import DistributedDataParallel as DDP

        found = self.found or {}
        self._modules = {id(v): k for k, v in state.items()
                         if isinstance(v, nn.Module) and not isinstance(v, DDP) and k not in found}
        if self._modules and self._hook is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._hook = register_module_forward_pre_hook(self._on_forward)

    def _on_forward(self, module: Any, _inputs: Any) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        if issubclass(type(module), DDP):
            key = self._modules.get(id(module.module))
            if key is not None:
                self.adopt(key, module)

    def adopt(self, key: str, wrapper: Any) -> None:
        """Every rank: record `wrapper` (a DistributedDataParallel module) under `key`, pinning a
        layout restored for that key. Before the wrapper's first backward."""
        if self.found is None:
            self.found = {}
        if key in self.found and self.found[key].ddp is wrapper:
            return
        buckets = self.found[key] = DDPBuckets(wrapper)
        layout = self.pending.pop(key, None)
        if layout:
            buckets.load_state_dict({"buckets": layout})
        self._modules = {i: k for i, k in self._modules.items() if k != key}
        if not self._modules:
            self._unhook()

    def step_boundary(self) -> None:
        """The first step has run: stop watching; a layout still pending found no wrapper."""
        if self._hook is None and not self.pending:
            return
        self._unhook()
        self._modules = {}
        if self.pending:
            log.warning("DDP bucket layout of %s restored but not applied: no DDP wrapper of it ran before the "
                        "first step; wrap the model before its first forward (or pass the wrapper to "
                        "Checkpointer.track_ddp): with 3+ ranks the resumed run may differ in the last bits",
                        ", ".join(sorted(self.pending)))
            self.pending = {}

    def _unhook(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


class _Pinned:
    """A restored layout whose wrapper has not run yet, saved as it was restored."""

    def __init__(self, layout: str) -> None:
        self.layout = layout

    def state_dict(self) -> dict[str, str]:
        return {"buckets": self.layout}


def _distributed() -> bool:
    dist_mod = sys.modules.get("torch.distributed")
    return bool(dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized()
                and dist_mod.get_world_size() >= 2)

"""slurmresume: preemptible PyTorch training on Slurm without lost work.

The library half, used inside training scripts. Importing it is cheap: names are loaded on
first use (PEP 562), so neither the CLI nor `import slurmresume` pays for torch, typer, rich or
submitit until it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpointer": "checkpointer",
    "CheckpointInfo": "checkpoint.store",
    "find_latest": "checkpoint.store",
    "list_checkpoints": "checkpoint.store",
    "ResumableSampler": "sampler",
    "SeededDataset": "seeding",
    "sample_seed": "seeding",
    "RetentionPolicy": "retention",
    "SavePolicy": "policy",
    "apply_policy": "retention",
    "compare_checkpoints": "compare",
    "ignore_in_worker": "signals",
    "DDPBuckets": "ddp",
    "EXIT_PREEMPTED": "signals",
    "EXIT_TERMINATED": "signals",
    "SlurmResumeError": "errors",
    "ConfigError": "errors",
    "CheckpointError": "errors",
    "CorruptCheckpointError": "errors",
    "UnsafeCheckpointError": "errors",
    "SaveError": "errors",
    "NoCheckpointError": "errors",
    "SlurmError": "errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slurmresume' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # static checkers see the real names
    from .checkpoint.store import CheckpointInfo, find_latest, list_checkpoints
    from .checkpointer import Checkpointer
    from .compare import compare_checkpoints
    from .ddp import DDPBuckets
    from .errors import (
        CheckpointError,
        ConfigError,
        CorruptCheckpointError,
        NoCheckpointError,
        SaveError,
        SlurmError,
        SlurmResumeError,
        UnsafeCheckpointError,
    )
    from .policy import SavePolicy
    from .retention import RetentionPolicy, apply_policy
    from .sampler import ResumableSampler
    from .seeding import SeededDataset, sample_seed
    from .signals import EXIT_PREEMPTED, EXIT_TERMINATED, ignore_in_worker

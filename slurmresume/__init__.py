"""slurmresume: preemptible PyTorch training on Slurm without lost work.

The library half, used inside training scripts. Importing it is cheap: names are loaded on
first use (PEP 562), so neither the CLI nor `import slurmresume` pays for torch, typer, rich or
submitit until it needs them.
"""

from __future__ import annotations

import importlib
import time
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
IMPORTED_AT = time.time()  # for the start-up breakdown of the `restored` event (after the script's imports)

_EXPORTS = {
    "Checkpointer": "train.checkpointer",
    "CheckpointInfo": "checkpoint.store",
    "find_latest": "checkpoint.store",
    "list_checkpoints": "checkpoint.store",
    "ResumableSampler": "train.sampler",
    "SeededDataset": "train.seeding",
    "sample_seed": "train.seeding",
    "RetentionPolicy": "retention",
    "SavePolicy": "train.policy",
    "apply_policy": "retention",
    "compare_checkpoints": "tools.compare",
    "ignore_in_worker": "train.signals",
    "DDPBuckets": "train.ddp",
    "EXIT_PREEMPTED": "train.signals",
    "EXIT_TERMINATED": "train.signals",
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
    from .retention import RetentionPolicy, apply_policy
    from .tools.compare import compare_checkpoints
    from .train.checkpointer import Checkpointer
    from .train.ddp import DDPBuckets
    from .train.policy import SavePolicy
    from .train.sampler import ResumableSampler
    from .train.seeding import SeededDataset, sample_seed
    from .train.signals import EXIT_PREEMPTED, EXIT_TERMINATED, ignore_in_worker

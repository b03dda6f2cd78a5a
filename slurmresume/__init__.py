"""slurmresume: preemptible PyTorch training on Slurm without lost work.

The library half, used inside training scripts. Importing it is cheap: names are loaded on
first use (PEP 562), so neither the CLI nor `import slurmresume` pays for torch, typer, rich or
submitit until it needs them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import importtime  # noqa: F401  (first: the start-up breakdown's mark, importtime.IMPORTED_AT)

__version__ = "0.1.0"

_EXPORTS = {
    "Checkpointer": "train.checkpointer",
    "CheckpointInfo": "checkpoint.store",
    "find_latest": "checkpoint.store",
    "list_checkpoints": "checkpoint.store",
    "ResumableSampler": "train.sampler",
    "SeededDataset": "train.seeding",
    "sample_seed": "train.seeding",
    "RetentionPolicy": "retention",
    "SavePolicy": "train.savepolicy",
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
    "PeerReadError": "errors",
    "UnreadableCheckpointError": "errors",
    "NotPermittedError": "errors",
    "RankFailedError": "errors",
    "RootOwnedError": "ownership",
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
    """The API (`__all__`) and the module's dunders, not its own imports and bookkeeping."""
    return sorted({n for n in globals() if n.startswith("__")} | set(__all__))


if TYPE_CHECKING:  # static checkers see the real names, explicitly re-exported (`X as X`)
    from .checkpoint.store import CheckpointInfo as CheckpointInfo
    from .checkpoint.store import find_latest as find_latest
    from .checkpoint.store import list_checkpoints as list_checkpoints
    from .errors import CheckpointError as CheckpointError
    from .errors import ConfigError as ConfigError
    from .errors import CorruptCheckpointError as CorruptCheckpointError
    from .errors import NoCheckpointError as NoCheckpointError
    from .errors import NotPermittedError as NotPermittedError
    from .errors import PeerReadError as PeerReadError
    from .errors import RankFailedError as RankFailedError
    from .errors import SaveError as SaveError
    from .errors import SlurmError as SlurmError
    from .errors import SlurmResumeError as SlurmResumeError
    from .errors import UnreadableCheckpointError as UnreadableCheckpointError
    from .errors import UnsafeCheckpointError as UnsafeCheckpointError
    from .ownership import RootOwnedError as RootOwnedError
    from .retention import RetentionPolicy as RetentionPolicy
    from .retention import apply_policy as apply_policy
    from .tools.compare import compare_checkpoints as compare_checkpoints
    from .train.checkpointer import Checkpointer as Checkpointer
    from .train.ddp import DDPBuckets as DDPBuckets
    from .train.sampler import ResumableSampler as ResumableSampler
    from .train.savepolicy import SavePolicy as SavePolicy
    from .train.seeding import SeededDataset as SeededDataset
    from .train.seeding import sample_seed as sample_seed
    from .train.signals import EXIT_PREEMPTED as EXIT_PREEMPTED
    from .train.signals import EXIT_TERMINATED as EXIT_TERMINATED
    from .train.signals import ignore_in_worker as ignore_in_worker

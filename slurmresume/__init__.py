"""slurmresume: preemptible PyTorch training on Slurm without lost work.

The library half, used inside training scripts. Importing it is cheap: no typer, rich or
submitit; torch and safetensors are imported where used.
"""

from .checkpoint.store import CheckpointInfo, find_latest, list_checkpoints
from .checkpointer import Checkpointer
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
from .sampler import ResumableSampler
from .signals import EXIT_PREEMPTED, EXIT_TERMINATED, ignore_in_worker

__version__ = "0.1.0"

__all__ = [
    "Checkpointer",
    "CheckpointInfo",
    "ResumableSampler",
    "find_latest",
    "list_checkpoints",
    "ignore_in_worker",
    "EXIT_PREEMPTED",
    "EXIT_TERMINATED",
    "SlurmResumeError",
    "ConfigError",
    "CheckpointError",
    "CorruptCheckpointError",
    "UnsafeCheckpointError",
    "SaveError",
    "NoCheckpointError",
    "SlurmError",
]

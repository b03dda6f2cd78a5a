"""`Checkpointer`'s arguments, checked before anything is set up: a wrong one is a `ConfigError`
that names it, raised before a process group, a lease or a signal handler exists."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def check_options(save_every: Any, async_overlap: Any, retention: Any, on_save_error: Any,
                  save_policy: Any) -> None:
    from ..retention import RetentionPolicy
    from .savepolicy import SavePolicy

    if save_every is not None and (not isinstance(save_every, int) or save_every < 1):
        raise ConfigError(f"save_every must be a positive integer or None, got {save_every!r}")
    if async_overlap not in ("wait", "skip"):
        raise ConfigError(f"async_overlap must be 'wait' or 'skip', got {async_overlap!r}")
    if retention is not None and not isinstance(retention, RetentionPolicy):
        raise ConfigError(f"retention must be a slurmresume.RetentionPolicy, got {type(retention).__name__}")
    if on_save_error not in ("raise", "warn"):
        raise ConfigError(f"on_save_error must be 'raise' or 'warn', got {on_save_error!r}")
    if save_policy is not None and save_every is not None:
        raise ConfigError("pass either save_every or save_policy, not both")
    if save_policy is not None and not isinstance(save_policy, SavePolicy):
        raise ConfigError(f"save_policy must be a slurmresume.SavePolicy, got {type(save_policy).__name__}")

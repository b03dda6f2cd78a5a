"""How long the mirror may wait, and how often it retries: every transfer is bounded.

Read once from the environment (the user's, or the job's: `submit` passes it on), validated
here (one ConfigError line naming the variable). The defaults keep a pull inside `restore()`
within the hang watch's save/restore floor (300 s), and `close()` within the same.

| variable                              | default | what                                             |
|---------------------------------------|---------|--------------------------------------------------|
| SLURMRESUME_MIRROR_CONNECT_TIMEOUT    | 10      | seconds to open a connection                     |
| SLURMRESUME_MIRROR_READ_TIMEOUT       | 30      | seconds without a byte before a request fails    |
| SLURMRESUME_MIRROR_ATTEMPTS           | 4       | tries per request and per part (backoff between) |
| SLURMRESUME_MIRROR_CLOSE_DEADLINE     | 240     | seconds `close()` waits for the last upload      |
| SLURMRESUME_MIRROR_PULL_DEADLINE      | 240     | seconds a pull inside `restore()` may take       |
| SLURMRESUME_MIRROR_UPLOAD_MIB         | 128     | MiB of file parts an upload holds at once        |

The last bounds an upload's memory: parts in flight x part size (upload.plan_upload: 8 MiB
parts, so 10 in flight by default; fewer for the larger parts of very large shards).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..errors import ConfigError

ENV_PREFIX = "SLURMRESUME_MIRROR_"

@dataclass(frozen=True, kw_only=True)
class MirrorSettings:
    connect_timeout: float = 10.0  # seconds to open a connection
    read_timeout: float = 30.0  # seconds without a byte on an open connection
    attempts: int = 4  # tries per request (botocore's standard mode) and per download/upload part
    close_deadline: float = 240.0  # seconds close() waits for the uploader (then: mirror_behind)
    pull_deadline: float = 240.0  # seconds one pull (download of one step) inside restore() may take
    backoff: float = 0.5  # first pause between tries of a part, doubled each time, at most 8 s
    upload_mib: int = 128  # MiB of file parts one upload holds in memory at once (parts in flight x part size)

    def __post_init__(self) -> None:
        for name in ("connect_timeout", "read_timeout", "close_deadline", "pull_deadline"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{ENV_PREFIX}{name.upper()} must be a positive number of seconds, got {value}")
        if self.attempts < 1:
            raise ConfigError(f"{ENV_PREFIX}ATTEMPTS must be >= 1, got {self.attempts}")
        if self.upload_mib < 1:
            raise ConfigError(f"{ENV_PREFIX}UPLOAD_MIB must be >= 1 (MiB), got {self.upload_mib}")

    def pause(self, attempt: int) -> float:
        """Seconds to wait before try `attempt + 1` (attempt counts from 1)."""
        return float(min(8.0, self.backoff * 2 ** (attempt - 1)))

    @classmethod
    def from_env(cls) -> MirrorSettings:
        values: dict[str, float | int] = {}
        for name, kind in (("connect_timeout", float), ("read_timeout", float), ("attempts", int),
                           ("close_deadline", float), ("pull_deadline", float), ("upload_mib", int)):
            raw = os.environ.get(ENV_PREFIX + name.upper())
            if raw is None or raw == "":
                continue
            try:
                values[name] = kind(raw.strip().removesuffix("s"))
            except ValueError:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r} is not a number") from None
        return cls(**values)  # type: ignore[arg-type]

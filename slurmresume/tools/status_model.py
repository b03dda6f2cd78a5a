"""The data `status` computes (`Status`, its rows, the Slurm job) and its strict JSON form; the
schema is documented in tools/status.py, whose `compute_status` fills these."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, cast

from ..job.leadtime import LeadReport
from ..train.savepolicy import IntervalSummary
from .health import Headline

SCHEMA = "slurmresume.tools.status/1"


@dataclass
class JobInfo:
    job_id: str | None = None
    state: str | None = None
    reason: str = ""
    elapsed: str = ""
    exit_code: str = ""
    source: str | None = None
    runs: int = 0


@dataclass
class CheckpointRow:
    step: int
    name: str
    path: str
    state: str
    created: float
    age_seconds: float
    bytes: int
    shards: int | None
    verified: bool | None
    metrics: Any
    newest: bool = False
    best: bool = False
    problem: str | None = None


@dataclass
class Status:
    root: str
    now: float
    job: JobInfo
    slurm: dict[str, Any]
    requeues: int
    event_counts: dict[str, int]
    history: list[dict[str, Any]]
    checkpoints: list[CheckpointRow]
    newest_complete: int | None
    best: dict[str, Any] | None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    interval: IntervalSummary | None = None
    omitted: int = 0
    verdict: Headline | None = None
    ranks: dict[str, Any] | None = None
    last_hang: dict[str, Any] | None = None
    lead: LeadReport | None = None
    writer: dict[str, Any] | None = None
    preemption_cost: dict[str, Any] | None = None
    mirror: dict[str, Any] | None = None  # the bucket, asked now (mirror_check): newest there, in flight, lag
    failures: list[dict[str, Any]] = field(default_factory=list)  # each unwarned failure (tools/failures.py)

    @property
    def health(self) -> str:
        return "error" if self.problems else "warning" if self.warnings else "ok"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.verdict is not None:
            data["verdict"]["exit_code"] = self.verdict.exit_code
        if data["interval"] is None:
            del data["interval"]
        if not data["omitted"]:
            del data["omitted"]
        if not data["failures"]:
            del data["failures"]
        return cast(dict[str, Any], plain_json({"schema": SCHEMA, "health": self.health, **data}))


def plain_json(obj: Any) -> Any:
    """Strict JSON data: tuples become lists, non-finite floats and other values strings."""
    if isinstance(obj, dict):
        return {str(k): plain_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain_json(v) for v in obj]
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj) if math.isfinite(obj) else str(float(obj))
    return str(obj)

"""The append-only event log next to the checkpoints (JSON lines), written by rank 0 / launchers."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from .checkpoint.layout import EVENTS

MAX_EVENT_LOG = 64 << 20


def append_event(root: Path, name: str, /, **fields: Any) -> None:
    """Append one event. A single O_APPEND write keeps lines whole across processes."""
    record = {
        "time": time.time(),
        "event": name,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT") or os.environ.get("SLURMRESUME_RESTART_COUNT") or 0),
        **fields,
    }
    line = (json.dumps(record, separators=(",", ":"), default=str) + "\n").encode()
    root.mkdir(parents=True, exist_ok=True, mode=0o755)
    fd = os.open(root / EVENTS, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_events(root: Path) -> list[dict[str, Any]]:
    """All well-formed events, oldest first; a torn or foreign line is skipped."""
    path = root / EVENTS
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_EVENT_LOG)
    except FileNotFoundError:
        return []
    out = []
    for line in data.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("event"), str):
            out.append(rec)
    return out

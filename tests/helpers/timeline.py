"""A synthetic event log of a run with 2 preemptions and 1 failure, shaped like what the
launcher and the Checkpointer write (event names and fields), for `status --plot` tests and
docs/timeline-example.png."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def example_events(t0: float = 1_764_000_000.0, rate: float = 1.0) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def ev(t: float, name: str, **fields: Any) -> None:
        out.append({"time": t0 + t, "event": name, "host": "n1", "pid": 1, "job_id": "4242", **fields})

    def run(start: float, step0: int, until: float, restart: int, every: float = 120.0) -> int:
        ev(start, "started", restart=restart, run_id=f"4242.{restart}.0")
        if step0:
            ev(start + 8, "restored", step=step0)
        t, step = start + 8, step0
        while t + every <= until:
            t += every
            step = step0 + int((t - start - 8) * rate)
            ev(t, "save_committed", step=step, seconds=2.5, reason="periodic", interval_s=every)
        return step

    ev(-30, "submitted", job="4242")
    run(0, 0, 900, 0)
    s = int((900 - 8) * rate)  # warning 1 at t=900: agreed step saved, requeued
    ev(900, "signal_agreed", step=s, kind="preempt")
    ev(903, "save_committed", step=s, seconds=2.5, reason="preempt")
    ev(904, "run_ended", outcome="preempt", action="requeue")
    ev(905, "requeued", restart=1, reason="warning signal, step committed")
    last = run(1000, s, 1700, 1)  # crash at t=1790, 90 s after the last commit
    ev(1790, "run_ended", outcome="failed", returncode=1, action="retry")
    ev(1790, "failed", returncode=1, reason="rank 1 exited 1 (CUDA error)")
    run(1810, last, 2650, 1)
    s2 = last + int((2650 - 1818) * rate)  # warning 2 at t=2650
    ev(2650, "signal_agreed", step=s2, kind="preempt")
    ev(2653, "save_committed", step=s2, seconds=2.5, reason="preempt")
    ev(2654, "requeued", restart=2, reason="warning signal, step committed")
    run(2760, s2, 3400, 2)
    s3 = s2 + int((3400 - 2768) * rate)
    ev(3400, "save_committed", step=s3, seconds=2.5, reason="final")
    ev(3401, "finished", step=s3, reason="training script exited 0")
    return out


def write_events(root: Path, events: list[dict[str, Any]]) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "events.jsonl", "w") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")

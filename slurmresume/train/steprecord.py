"""`slurmresume drill`: each rank's record of the steps it ran and the metrics it passed, so the
drill can check that every restarted run resumed the step the previous one committed, and that
both runs produced the same metric streams (not only the same final state).

Only under the drill ($SLURMRESUME_DRILL_RECORD names a directory outside the checkpoint root):
each rank appends one JSON line per `ckpt.step()` and per explicit `ckpt.save()` to
`rank-<R>.jsonl`: {"run": run id, "step": N, "call": "step" | "save", "metrics": encoded}, and
"partial_epoch": [keys] when the caller said some of them aggregate an epoch the process ran
only part of (the drill does not compare those there).
Metrics are encoded as in a manifest (`jsonenc.encode`), tensors as dtype + raw bytes (hex), so
that equal lines mean bitwise-equal values. A process killed while appending leaves at most a
partial last line, which the reader skips.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ..checkpoint.jsonenc import dumps, encode
from ..contract import ENV_DRILL_RECORD, ENV_RUN_ID

# saves the library makes itself (from step(), after a signal): recorded through step() already
INTERNAL_SAVES = frozenset({"periodic", "drill_first", "preempt", "terminate", "async"})


def _tensor_bits(_path: list[str], tensor: Any) -> str:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return f"{flat.dtype}{list(tensor.shape)}:{flat.view(torch.uint8).numpy().tobytes().hex()}"


def encode_metrics(metrics: Any) -> Any:
    """Plain JSON for `metrics`, equal for bitwise-equal values; a value the encoding refuses
    becomes its repr (the drill compares what it can rather than failing the run)."""
    try:
        return encode(metrics, _tensor_bits)
    except Exception:  # the record must never break training: fall back to a description
        return {"__repr__": repr(metrics)[:200]}


class StepRecorder:
    """One rank's record file (see the module doc). Local; never raises into training."""

    def __init__(self, directory: Path, rank: int, run_id: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(directory / f"rank-{rank}.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._run = run_id

    def record(self, step: int, call: str, metrics: Any, partial_epoch: Collection[str] = ()) -> None:
        entry = {"run": self._run, "step": step, "call": call, "metrics": encode_metrics(metrics)}
        if partial_epoch:
            entry["partial_epoch"] = sorted(map(str, partial_epoch))
        line = dumps(entry)
        try:
            os.write(self._fd, (line + "\n").encode())
        except OSError:
            pass  # a full disk shows as a missing step in the drill, never as a crashed run


def recorder_from_env(rank: int) -> StepRecorder | None:
    directory = os.environ.get(ENV_DRILL_RECORD)
    if not directory:
        return None
    return StepRecorder(Path(directory), rank, os.environ.get(ENV_RUN_ID) or "bare")


def read_records(directory: Path, rank: int) -> list[dict[str, Any]]:
    """Rank `rank`'s records in the order written; an unparsable (partial) line is skipped."""
    path = directory / f"rank-{rank}.jsonl"
    out = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("step"), int):
                out.append(rec)
    return out

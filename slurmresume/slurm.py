"""The one seam that runs Slurm's commands (sbatch, squeue, sacct, scontrol), plus pure parsers.

Tests replace `run` (or put fake commands first on PATH) to check command construction; the
end-to-end tests use the real commands against the real cluster.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from .errors import SlurmError


def run(args: list[str], timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command; SlurmError when it is missing, hangs or fails."""
    if shutil.which(args[0]) is None:
        raise SlurmError(f"no {args[0]} on PATH: install Slurm's client tools, or use --local to run here")
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise SlurmError(f"`{' '.join(args)}` did not answer within {timeout:.0f} s") from None
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise SlurmError(f"`{' '.join(args)}` failed: {msg[-1] if msg else f'exit {proc.returncode}'}")
    return proc


def available() -> bool:
    return shutil.which("sbatch") is not None


def requeue(job_id: str) -> None:
    """`scontrol requeue`: kills this allocation at once, so call it last, after the commit."""
    run(["scontrol", "requeue", job_id])


def hostnames(nodelist: str) -> list[str]:
    return run(["scontrol", "show", "hostnames", nodelist]).stdout.split()


@dataclass(frozen=True)
class JobRow:
    job_id: str
    state: str
    elapsed: str = ""
    nodes: str = ""
    restarts: int = 0
    exit_code: str = ""
    reason: str = ""


def parse_squeue(text: str) -> list[JobRow]:
    """Rows of `squeue -h -o %i|%T|%M|%N|%r`."""
    rows = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 4:
            rows.append(JobRow(parts[0], parts[1], parts[2], parts[3], reason=parts[4] if len(parts) > 4 else ""))
    return rows


def parse_sacct(text: str) -> list[JobRow]:
    """Rows of `sacct -n -P -X -D -o JobID,State,Elapsed,NodeList,ExitCode` (one per run,
    requeued runs included with -D). `restarts` counts the runs before each row."""
    rows: list[JobRow] = []
    seen: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 5 or not parts[0]:
            continue
        job = parts[0]
        n = seen.get(job, 0)
        seen[job] = n + 1
        rows.append(JobRow(job, parts[1].split()[0], parts[2], parts[3], n, parts[4]))
    return rows


def sacct(job_id: str) -> list[JobRow]:
    out = run(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o", "JobID,State,Elapsed,NodeList,ExitCode"])
    return parse_sacct(out.stdout)


def squeue(job_id: str) -> list[JobRow]:
    out = run(["squeue", "-h", "-j", job_id, "-o", "%i|%T|%M|%N|%r"])
    return parse_squeue(out.stdout)

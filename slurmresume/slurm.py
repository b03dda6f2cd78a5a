"""The one seam that runs Slurm's commands (sbatch, squeue, sacct, scontrol), plus pure parsers.

Tests replace `run` (or put fake commands first on PATH) to check command construction; the
end-to-end tests use the real commands against the real cluster.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable
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


def requeue(job_id: str, timeout: float = 30.0) -> None:
    """`scontrol requeue`: kills this allocation at once, so call it last, after the commit."""
    run(["scontrol", "requeue", job_id], timeout=timeout)


DEFAULT_KILL_WAIT_S = 30.0  # Slurm's own default, used when `scontrol show config` does not answer
REQUEUE_BACKOFF_S = (1.0, 2.0, 4.0, 8.0)  # then 8 s between attempts until the deadline


def requeue_with_retry(job_id: str, deadline: Callable[[], float], *, clock: Callable[[], float] = time.monotonic,
                       sleep: Callable[[float], None] = time.sleep,
                       attempt: Callable[[str, float], None] | None = None) -> list[str]:
    """`scontrol requeue`, retried with backoff until `deadline` (a `clock()` time). Returns the
    errors of the failed attempts (empty: the first one worked); raises SlurmError when no attempt
    succeeded in time. `deadline()` is asked again before each attempt (a SIGTERM during the
    retries shortens it to KillWait). At least one attempt is always made. Each attempt
    gets at most 30 s and never more than the time left, so a slow slurmctld cannot push the
    last try past the deadline (when Slurm's SIGKILL comes)."""
    call = attempt or (lambda job, t: requeue(job, timeout=t))
    errors: list[str] = []
    n = 0
    while True:
        left = deadline() - clock()
        try:
            call(job_id, max(1.0, min(30.0, left)))
            return errors
        except SlurmError as exc:
            errors.append(str(exc))
        pause = REQUEUE_BACKOFF_S[min(n, len(REQUEUE_BACKOFF_S) - 1)]
        n += 1
        if clock() + pause + 1.0 > deadline():
            raise SlurmError(f"`scontrol requeue {job_id}` failed {len(errors)} time(s) before the deadline; "
                             f"last: {errors[-1]}")
        sleep(pause)


@dataclass(frozen=True)
class JobTimes:
    """What `scontrol show job -o` says about a job's clock (None: not known)."""

    state: str = ""
    reason: str = ""
    time_limit_s: float | None = None
    run_time_s: float | None = None
    end_time: float | None = None  # seconds since the epoch


def parse_slurm_duration(text: str) -> float | None:
    """Slurm's [D-]HH:MM:SS or MM:SS as `scontrol show job` prints them; None for UNLIMITED,
    Partition_Limit or anything else."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+):(\d+)(?::(\d+))?", text.strip())
    if not m:
        return None
    days, a, b, c = m.groups()
    h, mi, s = (0, int(a), int(b)) if c is None else (int(a), int(b), int(c))
    return float(int(days or 0) * 86400 + h * 3600 + mi * 60 + s)


def parse_show_job(text: str) -> JobTimes:
    """The fields of `scontrol show job -o JOB` that tell a time limit from a cancel."""
    fields = dict(tok.split("=", 1) for tok in text.split() if "=" in tok)
    end = None
    raw_end = fields.get("EndTime", "")
    try:
        end = float(time.mktime(time.strptime(raw_end, "%Y-%m-%dT%H:%M:%S")))
    except ValueError:
        pass
    return JobTimes(fields.get("JobState", ""), fields.get("Reason", ""),
                    parse_slurm_duration(fields.get("TimeLimit", "")), parse_slurm_duration(fields.get("RunTime", "")),
                    end)


def job_times(job_id: str, timeout: float) -> JobTimes | None:
    """None when slurmctld does not answer within `timeout`."""
    try:
        return parse_show_job(run(["scontrol", "show", "job", "-o", job_id], timeout=timeout).stdout)
    except SlurmError:
        return None


def parse_kill_wait(text: str) -> float | None:
    """KillWait from `scontrol show config` ("KillWait = 30 sec")."""
    m = re.search(r"^KillWait\s*=\s*(\d+)", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def kill_wait(timeout: float) -> float:
    try:
        found = parse_kill_wait(run(["scontrol", "show", "config"], timeout=timeout).stdout)
    except SlurmError:
        found = None
    return found if found is not None else DEFAULT_KILL_WAIT_S


TIME_LIMIT_SLACK_S = 2.0  # clock skew between this node and slurmctld


def is_time_limit(now_info: JobTimes | None, end_at_start: float | None, now: float) -> bool:
    """Pure: was a SIGTERM that arrived at `now` Slurm's time limit (True) or a cancel (False)?

    The rule: ask slurmctld at the signal (`now_info`): Reason=TimeLimit, or RunTime >= TimeLimit,
    is the time limit (a time-limit SIGTERM is sent at or after the end, never before; `scancel`
    leaves Reason=None and RunTime short of the limit). When slurmctld did not answer, compare
    `now` with the EndTime read at start. Without either, it is not the time limit: a requeue
    must never undo a user's cancel, so doubt means cancel."""
    if now_info is not None and (now_info.reason or now_info.time_limit_s is not None):
        if now_info.reason == "TimeLimit":
            return True
        if now_info.time_limit_s is not None and now_info.run_time_s is not None:
            return now_info.run_time_s + TIME_LIMIT_SLACK_S >= now_info.time_limit_s
        return False
    return end_at_start is not None and now + TIME_LIMIT_SLACK_S >= end_at_start


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

"""Slurm's facts about the running job, for the launcher: its EndTime and KillWait (read once,
in the background) and whether a SIGTERM is the time limit or a cancel."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..slurm import DEFAULT_KILL_WAIT_S, is_time_limit, job_times
from ..slurm import kill_wait as slurm_kill_wait

if TYPE_CHECKING:
    from .relay import Relay

TERM_QUERY_TIMEOUT_S = 2.0  # asking slurmctld, at a SIGTERM, whether it is the time limit
START_QUERY_TIMEOUT_S = 5.0  # the job's EndTime and KillWait, read once at start
REQUEUE_BUDGET_S = 120.0  # the longest a requeue is retried when no SIGTERM bounds it


class JobClock:
    """Slurm's facts about this job, read once at start (EndTime, KillWait), and the rule that
    tells the time limit's SIGTERM from a cancel (`slurm.is_time_limit`).

    `read` asks slurmctld in a background thread: torchrun starts without waiting for the
    answers (a controller busy with a wave of preemptions answers slowly, exactly when a
    requeued job starts); the first use of `end_time` or `kill_wait` waits for them (each query
    bounded by START_QUERY_TIMEOUT_S, then Slurm's defaults)."""

    def __init__(self, job_id: str, end_time: float | None = None,
                 kill_wait: float = DEFAULT_KILL_WAIT_S) -> None:
        self.job_id = job_id
        self._end_time = end_time
        self._kill_wait = kill_wait
        self._reader: threading.Thread | None = None

    @classmethod
    def read(cls, job_id: str) -> JobClock:
        clock = cls(job_id)
        clock._reader = threading.Thread(target=clock._read, name="slurmresume-job-clock", daemon=True)
        clock._reader.start()
        return clock

    def _read(self) -> None:
        times = job_times(self.job_id, START_QUERY_TIMEOUT_S)
        self._end_time = times.end_time if times else None
        self._kill_wait = slurm_kill_wait(START_QUERY_TIMEOUT_S)

    def _wait(self) -> None:
        if self._reader is not None:
            self._reader.join()

    @property
    def end_time(self) -> float | None:
        self._wait()
        return self._end_time

    @property
    def kill_wait(self) -> float:
        self._wait()
        return self._kill_wait

    def classify_term(self, at: float) -> str:
        now = job_times(self.job_id, TERM_QUERY_TIMEOUT_S)
        return "time_limit" if is_time_limit(now, self.end_time, at) else "cancel"

    def requeue_deadline(self, relay: Relay, began: float) -> float:
        """A time.time() by which the requeue must have worked: KillWait after a SIGTERM (Slurm
        SIGKILLs us then; evaluated again before each attempt), else REQUEUE_BUDGET_S from `began`."""
        if relay.term_at is not None:
            return min(relay.term_at + self.kill_wait - 0.5, began + REQUEUE_BUDGET_S)
        return began + REQUEUE_BUDGET_S

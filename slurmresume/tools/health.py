"""The verdict at the top of `slurmresume status`: healthy / at risk / stopped, and why.

Pure: `judge(...)` takes the event log, the checkpoint rows, the Slurm state and the save
interval, and returns a `Headline`; nothing here reads a file or runs a command. The exit
code of `status` is `EXIT_CODES[headline.verdict]`.

Verdicts, in the order they are decided:
    stopped   Slurm reports the job ended badly, or the log's last word about the run is a
              terminal event other than "finished" (gave up, stopped, failed, requeue failed...)
    finished  the last run logged "finished"
    starting  nothing logged and no checkpoint yet
    at_risk   a corrupt checkpoint, the last save failed, the mirror lacks a committed step
              (`mirror_behind`, also after "finished"), or no commit for longer than
              RISK_FACTOR x the save interval while the run is not known to be waiting
    healthy   anything else
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..events import (
    EV_BRANCHED,
    EV_DISCARDED_NEWER,
    EV_FAILED,
    EV_FINISHED,
    EV_GAVE_UP,
    EV_HELD,
    EV_INTERRUPTED,
    EV_MIRROR_BEHIND,
    EV_MIRROR_FAILED,
    EV_MIRROR_UPLOADED,
    EV_NO_CHECKPOINT,
    EV_REQUEUE_FAILED,
    EV_REQUEUED,
    EV_RESTORED,
    EV_SAVE_COMMITTED,
    EV_SAVE_FAILED,
    EV_STARTED,
    EV_STOPPED,
    EV_SUBMITTED,
    MIRROR_PREFIX,
)

EXIT_HEALTHY = 0
EXIT_AT_RISK = 3
EXIT_STOPPED = 4
EXIT_UNKNOWN = 5  # Slurm is here but knows nothing of the job: nothing to call healthy
EXIT_CODES = {"healthy": EXIT_HEALTHY, "starting": EXIT_HEALTHY, "finished": EXIT_HEALTHY,
              "at_risk": EXIT_AT_RISK, "stopped": EXIT_STOPPED, "unknown": EXIT_UNKNOWN}
RISK_FACTOR = 1.5  # a commit later than 1.5 intervals is overdue (saves jitter by a step or two)
MIN_SAVES_FOR_RATE = 2  # steps/s and ETA need two commits of one run

# Events that end a run for good (the launcher writes them; unknown names are ignored).
STOPPED_EVENTS = {EV_GAVE_UP, EV_STOPPED, EV_FAILED, EV_REQUEUE_FAILED, EV_INTERRUPTED, EV_NO_CHECKPOINT, EV_HELD}
LIFECYCLE = STOPPED_EVENTS | {EV_STARTED, EV_REQUEUED, EV_FINISHED, EV_SUBMITTED, EV_RESTORED}
BAD_SLURM = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "TIMEOUT", "CANCELLED",
             "PREEMPTED"}
WAITING_SLURM = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING"}


@dataclass
class Headline:
    verdict: str  # one of EXIT_CODES
    reason: str  # one sentence: why
    last_step: int | None = None  # the newest step any event mentions
    last_step_time: float | None = None
    steps_per_second: float | None = None
    eta_s: float | None = None  # only when the log carries total_steps
    total_steps: int | None = None
    checkpoint_step: int | None = None  # the newest complete checkpoint
    checkpoint_time: float | None = None
    at_stake_s: float | None = None  # work a crash now would lose (seconds since that commit)
    at_stake_steps: int | None = None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def _rate(events: list[dict[str, Any]]) -> float | None:
    """Steps per second between the first and last commit of the newest run (None: < 2 commits)."""
    run_start = max((i for i, e in enumerate(events) if e.get("event") == EV_STARTED), default=0)
    saves: list[tuple[int, float]] = []
    for e in events[run_start:]:
        t = _num(e.get("time"))
        if e.get("event") == EV_SAVE_COMMITTED and isinstance(e.get("step"), int) and t is not None:
            saves.append((e["step"], t))
    if len(saves) < MIN_SAVES_FOR_RATE:
        return None
    (s0, t0), (s1, t1) = saves[0], saves[-1]
    return (s1 - s0) / (t1 - t0) if t1 > t0 and s1 > s0 else None


def _last_step(events: list[dict[str, Any]]) -> tuple[int | None, float | None]:
    for e in reversed(events):
        if isinstance(e.get("step"), int) and e.get("event") not in (EV_DISCARDED_NEWER, EV_BRANCHED):
            return e["step"], _num(e.get("time"))
    return None, None


def judge(events: list[dict[str, Any]], rows: list[Any], *, slurm_state: str | None, job_id: str | None,
          interval_s: float | None, problems: list[str], now: float) -> Headline:
    """The headline of `status` (see the module docstring for the rules)."""
    last_step, last_time = _last_step(events)
    newest = next((r for r in rows if r.state == "complete"), None)
    h = Headline("healthy", "", last_step, last_time, _rate(events))
    total = next((e["total_steps"] for e in reversed(events) if isinstance(e.get("total_steps"), int)), None)
    if total and h.steps_per_second and last_step is not None:
        h.total_steps, h.eta_s = total, max(0, total - last_step) / h.steps_per_second
    if newest is not None:
        h.checkpoint_step, h.checkpoint_time = newest.step, newest.created
    life = [e for e in events if e.get("event") in LIFECYCLE]
    last = life[-1] if life else None
    state = (slurm_state or "").split()[0] if slurm_state else ""
    h.verdict, h.reason = _verdict(events, last, state, job_id, newest, interval_s, problems, now)
    running = state in ("RUNNING", "COMPLETING") or (
        last is not None and last.get("event") in (EV_STARTED, EV_RESTORED) and state not in WAITING_SLURM)
    if running and h.verdict in ("healthy", "at_risk"):
        since = newest.created if newest is not None else _run_started(events, now)
        h.at_stake_s = max(0.0, now - since)
        if last_step is not None and newest is not None and last_step >= newest.step:
            h.at_stake_steps = last_step - newest.step
    if h.verdict in ("finished", "stopped"):
        h.eta_s = None
    return h


def _verdict(events: list[dict[str, Any]], last: dict[str, Any] | None, state: str, job_id: str | None,
             newest: Any, interval_s: float | None, problems: list[str], now: float) -> tuple[str, str]:
    if state in BAD_SLURM:
        return "stopped", f"Slurm reports job {job_id} as {state}"
    if last is not None and last["event"] == EV_FINISHED:
        lag = mirror_behind(events) or next((p for p in problems if p.startswith(BUCKET_BEHIND)), None)
        if lag:
            return "at_risk", f"finished at step {last.get('step', '?')}, but {lag}"
        return "finished", f"finished at step {last.get('step', '?')}"
    if last is not None and last["event"] in STOPPED_EVENTS:
        why = last.get("reason") or last.get("error") or (
            f"exit code {last['returncode']}" if last.get("returncode") is not None else "")
        return "stopped", f"{last['event'].replace('_', ' ')}" + (f": {why}" if why else "")
    if state == "COMPLETED":
        return "stopped", f"Slurm reports job {job_id} as COMPLETED but the log never says 'finished'"
    if state == "UNKNOWN":
        return "unknown", (f"Slurm knows no job {job_id} (squeue and sacct): another cluster, or purged from "
                           "accounting; pass --job ID to show another")
    if not events and newest is None:
        return "starting", "nothing logged yet: no run has started on this root"
    if problems:
        return "at_risk", problems[0]
    saves = [e for e in events if e.get("event") in (EV_SAVE_COMMITTED, EV_SAVE_FAILED)]
    if saves and saves[-1]["event"] == EV_SAVE_FAILED:
        return "at_risk", f"the last save (step {saves[-1].get('step')}) failed: {saves[-1].get('error')}"
    if state in WAITING_SLURM:
        return "healthy", f"waiting in the Slurm queue ({state})"
    since = now - (newest.created if newest is not None else _run_started(events, now))
    if interval_s and since > RISK_FACTOR * interval_s:
        what = f"since step {newest.step}" if newest is not None else "since the run started"
        return "at_risk", (f"no checkpoint committed for {_dur(since)} {what} (save interval {_dur(interval_s)}): "
                           "hung, killed, or saving too rarely")
    if last is None and not state:
        return "healthy", "saving (no launcher events: only runs started by `slurmresume submit` are tracked)"
    if last is not None and last["event"] == EV_REQUEUED:
        return "healthy", "requeued after a committed save: waiting to restart"
    return "healthy", "running" + (f" (Slurm: {state})" if state else "")


def mirror_behind(events: list[dict[str, Any]]) -> str | None:
    """Why the mirror lacks a step the run committed, from the log: the last `mirror_behind`
    (close() ended without the step on the bucket) not followed by an upload of that step or a
    newer one. None without a mirror, or when it caught up."""
    idx = max((i for i, e in enumerate(events) if e.get("event") == EV_MIRROR_BEHIND), default=None)
    if idx is None:
        return None
    behind = events[idx]
    raw = behind.get("step")
    step: int = raw if isinstance(raw, int) else -1
    later = [e["step"] for e in events[idx + 1:]
             if e.get("event") == EV_MIRROR_UPLOADED and isinstance(e.get("step"), int)]
    if later and max(later) >= step:
        return None
    uploaded = max((e["step"] for e in events[:idx] if e.get("event") == EV_MIRROR_UPLOADED
                    and isinstance(e.get("step"), int)), default=None)
    what = f"step {step}" if step >= 0 else "the newest step"
    return (f"the mirror {behind.get('url', '')} lacks {what} (newest uploaded: "
            f"{uploaded if uploaded is not None else 'none'}; {behind.get('error', '?')}): the next run with "
            "this mirror uploads it, or `python -m slurmresume.mirror push ROOT URL`")


BUCKET_BEHIND = "the mirror's bucket lacks"  # how bucket_lag's problem starts (at risk, also after "finished")


def bucket_lag(url: str, newest_local: int | None, local_age_s: float | None, bucket_newest: int | None,
               uploading: bool, grace_s: float) -> tuple[str, str] | None:
    """Pure: what `status` says of the bucket, asked at status time: ("problem", why) when its
    newest committed step is older than the newest local one (at risk: losing the root loses
    those steps), ("warning", why) while that step is still being uploaded (a multipart upload
    in flight, or committed less than `grace_s` ago); None when the bucket is level."""
    if newest_local is None or (bucket_newest is not None and bucket_newest >= newest_local):
        return None
    have = bucket_newest if bucket_newest is not None else "none"
    if uploading or (local_age_s is not None and local_age_s < grace_s):
        return "warning", f"the mirror {url} is uploading step {newest_local} (newest committed there: {have})"
    return "problem", (f"{BUCKET_BEHIND} step {newest_local} (newest committed in {url}: {have}): the next run with "
                       "this mirror uploads it, or `python -m slurmresume.mirror push ROOT URL`")


def mirror_url(events: list[dict[str, Any]]) -> str | None:
    """Pure: the mirror's s3:// location, from the newest mirror event in the log (None: no mirror)."""
    for e in reversed(events):
        url = e.get("url")
        if not (isinstance(url, str) and url.startswith("s3://") and str(e.get("event", "")).startswith(MIRROR_PREFIX)):
            continue
        head, _, last = url.rpartition("/")
        return head if last.startswith("step_") and head.count("/") >= 2 else url
    return None


def mirror_warning(events: list[dict[str, Any]]) -> str | None:
    """The mirror's lag while a run goes on: its last word is a failed upload (retried by the
    next commit, or at close). None without a mirror, or when its last upload succeeded."""
    last = next((e for e in reversed(events) if e.get("event") in (EV_MIRROR_UPLOADED, EV_MIRROR_FAILED,
                                                                     EV_MIRROR_BEHIND)), None)
    if last is None or last["event"] != EV_MIRROR_FAILED:
        return None
    uploaded = max((e["step"] for e in events if e.get("event") == EV_MIRROR_UPLOADED
                    and isinstance(e.get("step"), int)), default=None)
    return (f"the mirror's last upload (step {last.get('step', '?')}) failed: {last.get('error', '?')}; newest "
            f"step uploaded: {uploaded if uploaded is not None else 'none'}")


def _run_started(events: list[dict[str, Any]], now: float) -> float:
    t = next((_num(e.get("time")) for e in reversed(events) if e.get("event") == EV_STARTED), None)
    return t if t is not None else now


def _dur(s: float) -> str:
    from ..duration import format_duration

    return format_duration(s)

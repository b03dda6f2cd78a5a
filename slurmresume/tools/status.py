"""`status` and `verify` computed as plain data (never printed): is my run healthy?

`compute_status(...).to_json()` is what `slurmresume status --json` prints. Schema
"slurmresume.tools.status/1" (keys are stable; new keys may be added):

    schema        "slurmresume.tools.status/1"
    root, now     checkpoint root (str), time of the snapshot (epoch seconds)
    health        "ok" | "warning" | "error";  problems, warnings: [str] saying why
    verdict       the headline (health.judge): {verdict: "healthy"|"starting"|"finished"|"at_risk"
                   |"stopped", reason, exit_code (what `status` exits with), last_step,
                   last_step_time, steps_per_second, eta_s, total_steps, checkpoint_step,
                   checkpoint_time, at_stake_s, at_stake_steps}; null: not known yet
    slurm         {available: bool, note: str|null}
    job           {job_id, state, reason, elapsed, exit_code, source: "squeue"|"sacct"|null,
                   runs: int (Slurm runs of the job, requeues included; 0 unknown)}
    requeues      int: "requeued" events in the log (for the job, when one is known)
    event_counts  {event name: int};  history: [logged events, oldest first, the last N]
    checkpoints   newest first: [{step, name, path, state: "complete"|"corrupt"|"being_written"
                   |"incomplete", created, age_seconds, bytes, shards: int|null,
                   verified: bool|null (null: not checked), metrics, newest, best, problem}]
    newest_complete  step or null;  best: {metric, mode, step, value} or null
    omitted       only when compute_status(rows_limit=N) left older step directories out (their
                  number): large roots answer fast; `--limit 0` / `--best` / `--verify` list all
    ranks         the hang watch's last view of the newest run (null: none published): {job_key, time,
                   budgets (text), ranks: {rank: {step, phase, age_s (now - its last heartbeat),
                   median_s, p99_s, samples, ...}}, stragglers: [rank], straggler_margin,
                   memory: {host: {step (the memory tier's newest snapshot), bytes (held)}} or null}
    last_hang     the newest `hang` event (null: none): {time, run_id, ranks, step, phase, silent_s,
                   budget_s, dump_dir, rank_states, host}, plus hangs: int (all logged)
    interval      only with compute_status(with_interval=True): the save interval and its cost
                  (savepolicy.interval_summary; seconds unless named otherwise; null: not known yet)
                  {current_s, source: "logged"|"observed"|null, auto_s (Young/Daly clamped to
                   [min_s, max_s]), young_daly_s (unclamped sqrt(2*C*MTBF)), min_s, max_s,
                   save_cost_s (median of recent saves), saves: int, steps_per_second,
                   runtime_s, interruptions: int (unwarned: failed or killed runs),
                   failures_per_hour, mtbf_s, expected_loss: {interval_s, saves (C/T),
                   failures (T/(2*MTBF), null without an observed failure), total} or null}
    lead          {lead_s (the --signal-lead submit logged), predicted_save_s, predicted_bytes, basis:
                   "rate"|"seconds", required_s (2 x save + a step + 10 s), margin_s (lead - required),
                   step_s, late: [{step, seconds, lead_s, time}] emergency saves slower than the lead}
    writer        null, or {last_save (the strategy the newest save used), strategy (calibrated for
                   this root's file system), source, key, measured_at, gbps: {strategy: GB/s}, stale}
    preemption_cost  null (no run interrupted), or what requeues and failures cost (timeline.preemption_cost):
                  {interruptions: [{kind: "preempt"|"failed"|"hang", at (the warning, else the end of
                   the run), step, resumed_at (the next run's first step; null: not yet), down_s
                   (resumed_at - at, or now - at while ongoing; null: never restarted), lost_s,
                   lost_steps (work redone: since the last commit, 0 when the warned save committed),
                   lost_estimated, ongoing}], down_s, lost_s, wall_s (first start to the newest event,
                   or now while running or down), fraction ((down + lost) / wall), summary (the
                   headline's words)}
    failures      only when the log has one: each unwarned failure, oldest first (tools/failures.py):
                  [{run_id, kind: "failed"|"hang", at, step (where: the survivors' boundary, else the dead
                   ranks' last, else the furthest step reported; null: not known), dead: [rank],
                   dead_steps: {rank: last step}, trained (the furthest step before the failure),
                   save: "committed"|"refused"|"failed"|"none" (the failure save), save_step, save_writer,
                   save_s, missing: [piece] (refused), error (failed), action (the launcher's: retry,
                   requeue, give_up...), resumed_from (the step the next run restored; 0: fresh),
                   resumed_tier ("memory"|"file": where it restored from; null: not logged), restore_s,
                   repeated (trained - resumed_from), to_first_step_s (the failure to the next run's
                   first step; null: not resumed yet)}]
    mirror        null (no mirror in the log, or --no-mirror-check), or the bucket asked now: {url,
                   newest_local, newest_in_bucket, uploads_in_flight, last_error (the log's last
                   mirror_failed/mirror_behind), behind (bool; null: not asked), error (the bucket
                   could not be asked: a warning)}

Here: the gathering (`compute_status`) and the Slurm query (`query_job` over the `run_slurm` seam);
beside it, re-exported from here: `status_model` (the dataclasses, `plain_json`), `status_sections`
(checkpoint rows, ranks, writer, cost, mirror), `status_judge` (problems and warnings), `verify`.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from ..errors import ConfigError, SlurmError
from ..events import EV_HANG, EV_REQUEUED, read_events
from ..job.leadtime import LeadReport, lead_report
from ..slurm import parse_sacct, parse_squeue
from ..slurm import run as slurm_run
from ..train.savepolicy import interval_summary
from .failures import unwarned_failures
from .health import judge
from .status_judge import judge_health
from .status_judge import leftover_warnings as leftover_warnings
from .status_judge import root_warnings as root_warnings
from .status_model import SCHEMA as SCHEMA
from .status_model import CheckpointRow as CheckpointRow
from .status_model import JobInfo as JobInfo
from .status_model import Status as Status
from .status_model import plain_json as plain_json
from .status_sections import ask_mirror as ask_mirror
from .status_sections import checkpoint_rows
from .status_sections import cost_summary as cost_summary
from .status_sections import rank_view as rank_view
from .status_sections import writer_summary as writer_summary
from .verify import VerifyResult as VerifyResult
from .verify import verify_checkpoints as verify_checkpoints

SLURM_NOT_FOUND = "Slurm not found on this machine: showing checkpoints only"


def run_slurm(args: list[str], timeout: float = 10.0) -> str | None:
    """The seam for every Slurm command `status` runs (tests replace this function): stdout,
    or None when the command is not installed. Raises SlurmError on failure or timeout."""
    if shutil.which(args[0]) is None:
        return None
    return slurm_run(args, timeout).stdout


def compute_status(root: Path, *, job_id: str | None = None, best_metric: str | None = None,
                   mode: str = "min", verify: bool = False, now: float | None = None,
                   history_limit: int = 20, with_interval: bool = False,
                   rows_limit: int | None = None, mirror_check: bool = False) -> Status:
    """Snapshot of `root`, its event log and (when Slurm is here) the job. Reads only.
    `with_interval` adds the save-interval section (estimated from the event log).
    Raises ConfigError for a missing root, a bad mode, or a `best_metric` no complete
    checkpoint records. `mirror_check`: also ask the run's mirror (its URL from the log) how far
    behind it is, bounded by the mirror's timeouts (SLURMRESUME_MIRROR_*)."""
    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"checkpoint root {root} does not exist: pass --ckpt-dir or set SLURMRESUME_CKPT_DIR")
    if mode not in ("min", "max"):
        raise ConfigError(f"--mode must be 'min' or 'max', got {mode!r}")
    now = time.time() if now is None else now
    events = read_events(root)
    job_id = job_id or _logged_job_id(events)
    job, slurm_note = query_job(job_id)
    limit = None if (best_metric or verify) else rows_limit
    rows, best, omitted = checkpoint_rows(root, best_metric, mode, verify, now, limit)
    counts: dict[str, int] = {}
    for e in events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    requeues = sum(1 for e in events if e["event"] == EV_REQUEUED and (job_id is None or str(e.get("job_id")) == job_id))
    newest = next((r.step for r in rows if r.newest), None)
    status = Status(str(root), now, job, {"available": slurm_note != SLURM_NOT_FOUND, "note": slurm_note},
                    requeues, counts, events[-history_limit:] if history_limit else [], rows, newest, best,
                    interval=interval_summary(events) if with_interval else None, omitted=omitted)
    status.ranks = rank_view(root, now)
    hangs = [e for e in events if e["event"] == EV_HANG]
    if hangs:
        status.last_hang = {**{k: v for k, v in hangs[-1].items() if k not in ("event", "pid", "job_id")},
                            "hangs": len(hangs)}
    status.lead = _lead(events, rows)
    status.writer = writer_summary(root, events)
    status.preemption_cost = cost_summary(events, now)
    status.failures = [f.to_json() for f in unwarned_failures(events)]
    judge_health(status, root, events)
    if mirror_check:
        status.mirror = ask_mirror(events, rows, now, status.problems, status.warnings)
    iv = status.interval or interval_summary(events)
    status.verdict = judge(events, rows, slurm_state=job.state, job_id=job.job_id, interval_s=iv.current_s,
                           problems=status.problems, now=now)
    return status


def _lead(events: list[dict[str, Any]], rows: list[CheckpointRow]) -> LeadReport:
    from ..train.savepolicy import estimate_from_events

    newest = next((r for r in rows if r.newest), None)
    step_s = estimate_from_events(events).step_s if events else None
    return lead_report(events, step_s=step_s, size_now=newest.bytes if newest is not None and newest.bytes else None)


def _logged_job_id(events: list[dict[str, Any]]) -> str | None:
    """The newest Slurm job id in the log: a run's own `job_id`, or the `job` that `submit`
    recorded (logged from a login node, where SLURM_JOB_ID is unset)."""
    for e in reversed(events):
        for key in ("job_id", "job"):
            if e.get(key) and str(e[key]).replace("_", "").isdigit():
                return str(e[key])
    return None


def query_job(job_id: str | None) -> tuple[JobInfo, str | None]:
    """The job's live state (squeue), else its accounting (sacct), plus a note for the user."""
    try:
        if run_slurm(["squeue", "--version"]) is None:
            return JobInfo(job_id), SLURM_NOT_FOUND
    except SlurmError as exc:
        return JobInfo(job_id), str(exc)
    if job_id is None:
        return JobInfo(), "no job id in the event log: pass --job ID to show the Slurm job"
    job, note = JobInfo(job_id), None
    try:
        live = parse_squeue(run_slurm(["squeue", "-h", "-j", job_id, "-o", "%i|%T|%M|%N|%r"]) or "")
    except SlurmError:
        live = []  # a finished job drops out of squeue ("Invalid job id specified")
    try:
        runs = parse_sacct(run_slurm(["sacct", "-n", "-P", "-X", "-D", "-j", job_id, "-o",
                                      "JobID,State,Elapsed,NodeList,ExitCode"]) or "")
    except SlurmError as exc:
        runs, note = [], f"sacct: {exc}"
    job.runs = len(runs)
    if live:
        job.state, job.elapsed, job.reason, job.source = live[0].state, live[0].elapsed, live[0].reason, "squeue"
    elif runs:
        last = runs[-1]
        job.state, job.elapsed, job.exit_code, job.source = last.state, last.elapsed, last.exit_code, "sacct"
    else:  # neither knows it: never judged healthy (another cluster, a purged or mistyped id)
        job.state = "UNKNOWN"
        note = note or f"job {job_id} is not known to squeue or sacct"
    return job, note

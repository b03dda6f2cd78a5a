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
                   median_s, p99_s, samples, ...}}, stragglers: [rank], straggler_margin}
    last_hang     the newest `hang` event (null: none): {time, run_id, ranks, step, phase, silent_s,
                   budget_s, dump_dir, rank_states, host}, plus hangs: int (all logged)
    interval      only with compute_status(with_interval=True): the save interval and its cost
                  (policy.interval_summary; seconds unless named otherwise; null: not known yet)
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
    mirror        null (no mirror in the log, or --no-mirror-check), or the bucket asked now: {url,
                   newest_local, newest_in_bucket, uploads_in_flight, last_error (the log's last
                   mirror_failed/mirror_behind), behind (bool; null: not asked), error (the bucket
                   could not be asked: a warning)}
"""

from __future__ import annotations

import math
import numbers
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

from .. import slurm
from ..checkpoint.layout import LOCK, step_dirs
from ..checkpoint.store import (
    UNREADABLE,
    CheckpointInfo,
    check_checksums,
    inspect_dir,
    list_checkpoints,
)
from ..errors import ConfigError, SlurmError
from ..events import read_events
from ..job.leadtime import LeadReport, late_warning, lead_report, lead_warning
from ..retention import best_record, metric_names, metric_value, record_from_info
from ..slurm import parse_sacct, parse_squeue
from ..train.policy import IntervalSummary, interval_summary
from .health import Headline, bucket_lag, judge, mirror_behind, mirror_url, mirror_warning
from .timeline import cost_line, preemption_cost

SCHEMA = "slurmresume.tools.status/1"
SLURM_NOT_FOUND = "Slurm not found on this machine: showing checkpoints only"
_BAD_STATES = {"FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def run_slurm(args: list[str], timeout: float = 10.0) -> str | None:
    """The seam for every Slurm command `status` runs (tests replace this function): stdout,
    or None when the command is not installed. Raises SlurmError on failure or timeout."""
    if shutil.which(args[0]) is None:
        return None
    return slurm.run(args, timeout).stdout


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
    rows, best, omitted = _checkpoint_rows(root, best_metric, mode, verify, now, limit)
    counts: dict[str, int] = {}
    for e in events:
        counts[e["event"]] = counts.get(e["event"], 0) + 1
    requeues = sum(1 for e in events if e["event"] == "requeued" and (job_id is None or str(e.get("job_id")) == job_id))
    newest = next((r.step for r in rows if r.newest), None)
    status = Status(str(root), now, job, {"available": slurm_note != SLURM_NOT_FOUND, "note": slurm_note},
                    requeues, counts, events[-history_limit:] if history_limit else [], rows, newest, best,
                    interval=interval_summary(events) if with_interval else None, omitted=omitted)
    status.ranks = rank_view(root, now)
    hangs = [e for e in events if e["event"] == "hang"]
    if hangs:
        status.last_hang = {**{k: v for k, v in hangs[-1].items() if k not in ("event", "pid", "job_id")},
                            "hangs": len(hangs)}
    status.lead = _lead(events, rows)
    status.writer = writer_summary(root, events)
    status.preemption_cost = cost_summary(events, now)
    _judge(status, root, events)
    if mirror_check:
        status.mirror = ask_mirror(events, rows, now, status.problems, status.warnings)
    iv = status.interval or interval_summary(events)
    status.verdict = judge(events, rows, slurm_state=job.state, job_id=job.job_id, interval_s=iv.current_s,
                           problems=status.problems, now=now)
    return status


def ask_mirror(events: list[dict[str, Any]], rows: list[CheckpointRow], now: float, problems: list[str],
               warnings: list[str]) -> dict[str, Any] | None:
    """The bucket's side of the lag: one listing (and the newest step's marker and manifest)
    with the mirror's own timeouts and tries. None when the log names no mirror. A bucket that
    cannot be asked is a warning (the log's own account of the mirror still counts)."""
    url = mirror_url(events)
    if url is None:
        return None
    newest = next((r for r in rows if r.newest), None)
    failed = [e for e in events if e.get("event") in ("mirror_failed", "mirror_behind")]
    out: dict[str, Any] = {"url": url, "newest_local": newest.step if newest else None, "newest_in_bucket": None,
                           "uploads_in_flight": None, "last_error": failed[-1].get("error") if failed else None,
                           "behind": None, "error": None}
    try:
        from ..errors import CheckpointError, ConfigError
        from ..mirror import remote
        from ..mirror.s3 import client, parse_s3_url
        from ..mirror.settings import MirrorSettings

        settings = MirrorSettings.from_env()
        loc = parse_s3_url(url)
        s3 = client(settings)
        steps = remote.scan(s3, loc)
        latest = remote.find_latest(s3, loc, steps=steps)
    except (CheckpointError, ConfigError, OSError) as exc:
        out["error"] = str(exc)[:500]
        warnings.append(f"could not ask the mirror {url} how far behind it is: {out['error']}")
        return out
    out["newest_in_bucket"] = latest.step if latest else None
    out["uploads_in_flight"] = sum(rs.uploading for rs in steps)
    uploading = newest is not None and any(rs.uploading and rs.step == newest.step for rs in steps)
    lag = bucket_lag(url, out["newest_local"], newest.age_seconds if newest else None, out["newest_in_bucket"],
                     uploading, settings.close_deadline)
    out["behind"] = lag is not None
    if lag is not None and not any(url in p and "lacks" in p for p in problems):  # the log said it already
        (problems if lag[0] == "problem" else warnings).append(lag[1])
    return out


def rank_view(root: Path, now: float) -> dict[str, Any] | None:
    """The newest job's per-node summaries (`<root>/.runs/<job>.node-<n>.ranks.json`, written by
    each node's launcher every few seconds) merged, with ages recomputed at `now` and the
    stragglers named (hang.stragglers)."""
    import json

    from ..job.hang import STRAGGLER_MARGIN, stragglers

    groups: dict[str, list[dict[str, Any]]] = {}
    for path in (root / ".runs").glob("*.ranks.json"):
        try:
            data = json.loads(path.read_text()[:1 << 22])
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("ranks"), dict):
            groups.setdefault(path.name.rsplit(".node-", 1)[0], []).append(data)
    if not groups:
        return None
    key, nodes = max(groups.items(), key=lambda kv: max(float(d.get("time") or 0) for d in kv[1]))
    ranks: dict[str, Any] = {}
    for node in nodes:
        for rank, row in node["ranks"].items():
            if isinstance(row, dict):
                if isinstance(row.get("time"), (int, float)):
                    row["age_s"] = round(now - row["time"], 1)
                ranks[rank] = row
    medians = {int(r): float(v["median_s"]) for r, v in ranks.items() if isinstance(v.get("median_s"), (int, float))}
    samples = {int(r): int(v.get("samples") or 0) for r, v in ranks.items()}
    return {"job_key": key, "time": max(float(d.get("time") or 0) for d in nodes),
            "budgets": nodes[0].get("budgets"), "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0]))),
            "stragglers": stragglers(medians, samples), "straggler_margin": STRAGGLER_MARGIN}


def _lead(events: list[dict[str, Any]], rows: list[CheckpointRow]) -> LeadReport:
    from ..train.policy import estimate_from_events

    newest = next((r for r in rows if r.newest), None)
    step_s = estimate_from_events(events).step_s if events else None
    return lead_report(events, step_s=step_s, size_now=newest.bytes if newest is not None and newest.bytes else None)


def writer_summary(root: Path, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The write path chosen for this root's file system (the calibration cache) and the one the
    newest save used (event log); None when neither is known."""
    from ..checkpoint.calibrate import cached_choice

    last = next((e for e in reversed(events) if e.get("event") == "save_committed" and e.get("writer")), None)
    cached = cached_choice(root)
    if last is None and cached is None:
        return None
    return {"last_save": last.get("writer") if last else None, "last_breakdown": last.get("breakdown") if last else None,
            **(cached or {})}


def cost_summary(events: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
    """The measured down time and lost work of every interruption, their totals and share of the
    wall time, and the words the headline shows; None when no run was interrupted."""
    cost = preemption_cost(events, now)
    return None if cost is None else {**cost.to_json(), "summary": cost_line(cost)}


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


def _inspect_rows(root: Path, limit: int | None) -> tuple[list[CheckpointInfo], int]:
    """Newest first: all step directories, or the newest `limit` (continuing past them until a
    complete one is found), plus how many older ones were left out."""
    if limit is None:
        return list_checkpoints(root), 0
    dirs = step_dirs(root)
    infos: list[CheckpointInfo] = []
    for step, path in dirs:
        if len(infos) >= limit and any(i.complete for i in infos):
            break
        infos.append(inspect_dir(step, path))
    return infos, len(dirs) - len(infos)


def _checkpoint_rows(root: Path, best_metric: str | None, mode: str, verify: bool, now: float,
                     limit: int | None = None) -> tuple[list[CheckpointRow], dict[str, Any] | None, int]:
    infos, omitted = _inspect_rows(root, limit)
    records = [record_from_info(i) for i in infos]
    rows = [_row(i, r, verify, now) for i, r in zip(infos, records, strict=True)]
    newest = next((row for row in rows if row.state == "complete"), None)
    if newest is not None:
        newest.newest = True
    if not best_metric:
        return rows, None, omitted
    best = best_record(records, best_metric, mode)
    if best is None:
        if any(r.complete for r in records):
            raise ConfigError(f"no complete checkpoint records metric {best_metric!r}; "
                              f"metrics found: {', '.join(metric_names(records)) or 'none'}")
        return rows, None, omitted
    for row in rows:
        row.best = row.name == best.name
    return rows, {"metric": best_metric, "mode": mode, "step": best.step,
                  "value": metric_value(best.metrics, best_metric)}, omitted


def _row(info: CheckpointInfo, rec: Any, verify: bool, now: float) -> CheckpointRow:
    state = ("complete" if info.complete else "unreadable" if info.unreadable else "corrupt" if info.has_marker
             else "unreadable" if (info.problem or "").startswith(UNREADABLE)
             else "being_written" if rec.in_progress else "incomplete")
    verified, problem = None, info.problem
    if verify and info.complete and info.manifest is not None:
        problems = check_checksums(info.path, info.manifest)
        verified, problem = not problems, "; ".join(problems) or None
    return CheckpointRow(info.step, info.path.name, str(info.path), state, info.created,
                         max(0.0, now - info.created), info.total_bytes,
                         info.manifest.world_size if info.manifest else None, verified,
                         rec.metrics, problem=problem)


def _judge(status: Status, root: Path, events: list[dict[str, Any]]) -> None:
    """Fill problems and warnings: the verdict of `health`."""
    p, w = status.problems, status.warnings
    last = events[-1]["event"] if events else None
    if last in ("failed", "gave_up"):
        p.append(f"the last event is {last!r}: the run stopped (see the history)")
    if status.job.state and status.job.state.split()[0] in _BAD_STATES:
        p.append(f"Slurm reports job {status.job.job_id} as {status.job.state}")
    for row in status.checkpoints:
        if row.state == "corrupt" or row.verified is False:
            p.append(f"checkpoint {row.path} is corrupt: {row.problem}")
    lag = mirror_behind(events)
    if lag:
        p.append(lag)
    elif warning := mirror_warning(events):
        w.append(warning)
    if status.newest_complete is None:
        w.append(f"no complete checkpoint under {root} yet")
    for row in status.checkpoints:
        if row.state == "unreadable" and (row.problem or "").startswith(UNREADABLE):
            w.append(f"{row.name} is {row.problem}; skipped")
        elif row.state == "unreadable":  # by this version: restore refuses it rather than resume an older step
            blocks = not any(r.state == "complete" and r.step > row.step for r in status.checkpoints)
            (p if blocks else w).append(f"{row.name}: {row.problem}"
                                        + ("; restore refuses it (no resume) until then" if blocks else ""))
    leftovers = [r.name for r in status.checkpoints if r.state == "incomplete"]
    if leftovers:
        w.append(f"{len(leftovers)} incomplete director{'y' if len(leftovers) == 1 else 'ies'} "
                 f"({', '.join(leftovers[:3])}{', ...' if len(leftovers) > 3 else ''}): "
                 "`slurmresume prune --remove-incomplete-older-than 1d` removes old ones")
    saves = [e for e in events if e["event"] in ("save_committed", "save_failed")]
    if saves and saves[-1]["event"] == "save_failed":
        w.append(f"the last save failed: {saves[-1].get('error')}")
    if status.lead is not None:
        w.extend(late_warning(late) for late in status.lead.late)
        short = lead_warning(status.lead)
        if short:
            w.append(short)
    w.extend(root_warnings(root))
    w.extend(leftover_warnings(root))


def root_warnings(root: Path) -> list[str]:
    """Permission problems that let other users plant or delete checkpoints."""
    out = []
    mode = stat.S_IMODE(os.stat(root).st_mode)
    if mode & stat.S_IWOTH:
        out.append(f"checkpoint root {root} is world-writable (mode {mode:o}): any user here can plant "
                   f"or delete checkpoints; run `chmod o-w {root}`")
    try:
        if not stat.S_ISREG(os.lstat(root / LOCK).st_mode):
            out.append(f"lock file {root / LOCK} is a link or not a regular file: remove it")
    except FileNotFoundError:
        pass
    return out


def leftover_warnings(root: Path) -> list[str]:
    """Save and mirror-download directories still in the root (running, or left by a killed
    writer that cannot be proven dead from here), with their size."""
    from ..checkpoint.leftovers import listing

    return [f"{name} holds {size / 2**20:.1f} MiB: a save or mirror download that is running or was killed; "
            "the root's owner removes it at its next save (or `prune`) once its writer is provably dead and "
            "it is idle for 10 min" for name, size in listing(root)]


@dataclass
class VerifyResult:
    step: int
    path: str
    ok: bool
    problems: list[str]
    unreadable: bool = False  # not checked: this version cannot read it (newer format, over a cap); not corrupt


def verify_checkpoints(root: Path, step: int | None = None, every: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> list[VerifyResult]:
    """Recompute shard checksums: of `step`, of every marked directory (`every`), or of the
    newest complete one. Each problem names the bad file. Raises NoCheckpointError /
    ConfigError when there is nothing to verify."""
    from ..checkpoint.layout import step_dir_name
    from ..checkpoint.store import find_latest
    from ..errors import NoCheckpointError

    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"checkpoint root {root} does not exist: pass --ckpt-dir or set SLURMRESUME_CKPT_DIR")
    if every:
        infos = [i for i in list_checkpoints(root) if i.has_marker or i.unreadable
                 or (i.problem or "").startswith(UNREADABLE)]
    elif step is not None:
        infos = [inspect_dir(step, root / step_dir_name(step))]
        if not infos[0].path.is_dir():
            raise NoCheckpointError(f"no step {step} under {root}: `slurmresume status --ckpt-dir {root}` lists them")
        if not infos[0].has_marker:
            raise NoCheckpointError(f"step {step} under {root} is incomplete (no commit marker): nothing to verify")
    else:
        latest = find_latest(root, warn=False)
        infos = [latest] if latest is not None else []
    if not infos:
        raise NoCheckpointError(f"no complete checkpoint under {root} to verify")
    out = []
    for done, info in enumerate(infos, 1):
        out.append(_verify_one(info))
        if progress is not None:
            progress(done, len(infos))
    return out


def _verify_one(info: CheckpointInfo) -> VerifyResult:
    if info.manifest is None:
        return VerifyResult(info.step, str(info.path), False,
                            [f"{info.path.name}: {info.problem or 'unreadable manifest'}"], unreadable=info.unreadable)
    problems = check_checksums(info.path, info.manifest)
    return VerifyResult(info.step, str(info.path), not problems, problems)

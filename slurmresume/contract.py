"""The launcher <-> worker contract, declared once: the environment the launcher sets for the
ranks, the exit codes the ranks use, and the per-run outcome record rank 0 writes and the
launcher reads.

Why a record and not the event log: the log is the human history (append-only, shared by every
run on the root, unbounded, not atomic across NFS clients). A decision that ends or requeues a
job must not depend on searching it. Each run (one torchrun invocation, identified by
`SLURMRESUME_RUN_ID`) gets exactly one small JSON file, written atomically (temp, fsync, rename)
by global rank 0, under `<root>/.runs/`; the launcher of the first node reads it after torchrun
exits. Rank 0 may live on any node, so the record lives on the shared checkpoint root.

Whose record: a Slurm job id comes back (MaxJobId wrap, a reinstalled controller, another
cluster on the same root), so a run id is not enough. Every launch (one submission, kept across
its requeues; one `submit --local`) has a nonce ($SLURMRESUME_NONCE) that every record carries,
and the launcher believes only records with its own nonce (`read_*(..., nonce)`).

Who writes what:
    a node's launcher, before it kills a hung run: `<run id>.hang.json` (write_hang): the other
                                               nodes' launchers, whose ranks then fail in a
                                               collective, count their run as the same hang
    rank 0, after the agreed emergency save:   kind=preempt|terminate, step, committed=True
    rank 0, when that save failed:             kind=preempt|terminate, step, committed=False, error
    nobody (no record):                        the run finished or crashed; the launcher uses the
                                               exit code and the markers on disk
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# -- environment set by the launcher for every rank -------------------------------------------
ENV_ROOT = "SLURMRESUME_CKPT_DIR"  # the checkpoint root the run owns
ENV_SIGNAL = "SLURMRESUME_SIGNAL"  # the warning signal's name (USR1 unless --signal says)
ENV_RUN_ID = "SLURMRESUME_RUN_ID"  # one torchrun invocation: "<job key>.<restart>.<attempt>"
ENV_RESTART = "SLURMRESUME_RESTART_COUNT"  # requeues (Slurm) or local restarts so far
ENV_LAUNCHER_PID = "SLURMRESUME_LAUNCHER_PID"  # the node launcher (drill injections go there)
ENV_DRILL_AT = "SLURMRESUME_DRILL_AT"  # drill: "12,30,41" = warning at step 12 of restart 0, ...
ENV_HEARTBEAT_DIR = "SLURMRESUME_HEARTBEAT_DIR"  # node-local directory for per-rank heartbeats (heartbeat.py)
FAILSAVE_SUBDIR = "failsave"  # under $SLURMRESUME_HEARTBEAT_DIR: the failure-time save's per-rank files (train/failsave.py)
ENV_FAILSAVE_SHARED = "SLURMRESUME_FAILSAVE_SHARED"  # several nodes: where this run's survivors meet (shared root)
FAILSAVE_NOTICE = "remote"  # FIFO in the node-local failsave directory: readable once another node reported a death
FAILSAVE_DEAD_PREFIX = "dead-"  # dead-<rank>.json in the shared directory: a rank seen dead by its node
ENV_DUMP_SIGNAL = "SLURMRESUME_DUMP_SIGNAL"  # the signal (name) on which each rank dumps its stacks there
ENV_DRILL_HANG = "SLURMRESUME_DRILL_HANG"  # drill: "1:12,0:30" = rank 1 stops at step 12 of attempt 0, ...
ENV_NONCE = "SLURMRESUME_NONCE"  # this launch (one submission, or one `submit --local`): in every record
ENV_OWNER = "SLURMRESUME_OWNER"  # the owner id of the root's lease that this run holds (ownership.py)
ENV_LEASE_HEARTBEAT = "SLURMRESUME_LEASE_HEARTBEAT_S"  # the lease's refresh interval (default 30 s; tests)
ENV_TAKEOVER = "SLURMRESUME_TAKEOVER"  # "1": a bare Checkpointer may take over on weak evidence (--takeover)
ENV_MIRROR = "SLURMRESUME_MIRROR"  # s3://BUCKET/PREFIX every committed step is copied to (submit --mirror)
ENV_DRILL_FIRST_SAVE = "SLURMRESUME_DRILL_FIRST_SAVE"  # drill: "1" = save the first step of a fresh start
ENV_DRILL_RECORD = "SLURMRESUME_DRILL_RECORD"  # drill: directory where each rank records its steps
# set by the user (not the launcher): "1" lets restore() start from step 0 although the root
# holds committed step directories of which none loads (it refuses by default)
ENV_ALLOW_FRESH_START = "SLURMRESUME_ALLOW_FRESH_START"
# set by the user: bytes one rank may hold in staging memory while a restore verifies (default:
# half the node's available memory, shared by its ranks); a larger part is verified in a first
# read pass and read into the live tensors in a second; "0" always takes the two passes
ENV_RESTORE_STAGING = "SLURMRESUME_RESTORE_STAGING_BYTES"
# set by the user, "1": a restore whose files are all in the page cache (same world size) takes
# the two passes instead of staging (~5x faster warm), giving up one case of all-or-nothing: a
# file changed between the passes, or an RNG state that verifies but fails validation, leaves
# the live state half-loaded (with an error on every rank). Off by default: nothing is touched
# before the whole step verified and decoded.
ENV_RESTORE_WARM = "SLURMRESUME_RESTORE_WARM"
# the memory tier (train/memtier.py): a node-local checkpoint root on tmpfs, in the file tier's
# format, that the node launcher creates for the job, keeps across in-allocation restarts and
# removes when the job ends or is requeued (job/memroot.py); unset: no memory tier
ENV_MEMORY_DIR = "SLURMRESUME_MEMORY_DIR"
# the peer copy's cap, MB/s, read by the launchers (job/peercopy.py) and the ranks (peerpin.py); "0": none
ENV_PEER_COPY_MBS = "SLURMRESUME_PEER_COPY_MBS"
ENV_SNAPSHOT_EVERY = "SLURMRESUME_SNAPSHOT_EVERY"  # "auto" | "off" | N: the memory tier's interval (submit --snapshot-every)
# set by the user: the most bytes the memory tier may hold on one node (default: what tmpfs and
# MemAvailable allow, with headroom); a snapshot over it is refused with one warning
ENV_MEMORY_LIMIT = "SLURMRESUME_MEMORY_LIMIT_BYTES"


def parse_snapshot_every(value: object) -> int | None:
    """Pure: $SLURMRESUME_SNAPSHOT_EVERY's value (`submit --snapshot-every`,
    `Checkpointer(snapshot_every=)`) as an interval: 0 = off, N = every N steps, None = auto.
    Raises ValueError (the caller words it) for anything else."""
    text = str(value).strip().lower()
    if text == "auto":
        return None
    if text == "off":
        return 0
    if not text.isdigit():
        raise ValueError(f"{value!r} is not auto, off or a number of steps")
    return int(text)


# -- exit codes of a rank ---------------------------------------------------------------------
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: saved after the warning signal; the launcher requeues
EXIT_TERMINATED = 76  # saved (best effort) after SIGTERM/SIGINT; never self-requeued
EXIT_SAVE_FAILED = 77  # the emergency save after a signal failed; nothing new committed
EXIT_MIRROR_BEHIND = 78  # rank 0 at close(): the last committed step did not reach the mirror (mirror_behind)

# -- exit code of the node launcher -----------------------------------------------------------
# After a successful `scontrol requeue` the launcher exits at once with this code: the job is
# already REQUEUED in Slurm's record, and a non-zero code can never read as COMPLETED.
LAUNCHER_EXIT_REQUEUED = EXIT_PREEMPTED

# The event names (EV_*) the launcher adds to the human history are declared in events.py.

RUNS_DIR = ".runs"
_RUN_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,200}")
MAX_OUTCOME_BYTES = 64 << 10


@dataclass(frozen=True)
class Outcome:
    """What a run's ranks did about a signal, as rank 0 recorded it."""

    run_id: str
    kind: str  # "preempt" | "terminate"
    step: int  # the step all ranks agreed on
    committed: bool  # True only when this run's save of `step` has its commit marker
    error: str = ""
    nonce: str = ""  # the launch's ($SLURMRESUME_NONCE); `write_outcome` fills it in

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def outcome_path(root: Path, run_id: str) -> Path:
    if not _RUN_ID_RE.fullmatch(run_id) or run_id in (".", ".."):
        raise ValueError(f"run id {run_id!r} is not a plain name")
    return Path(root) / RUNS_DIR / f"{run_id}.json"


def write_outcome(root: Path, outcome: Outcome) -> None:
    """Rank 0 only. Atomic and durable (temp, fsync, rename, directory fsync). Stamped with this
    launch's nonce ($SLURMRESUME_NONCE) unless the outcome carries one."""
    from dataclasses import replace

    from .checkpoint.fsio import makedirs, write_durable

    path = outcome_path(root, outcome.run_id)
    makedirs(path.parent, 0o755)
    if not outcome.nonce:
        outcome = replace(outcome, nonce=os.environ.get(ENV_NONCE, ""))
    write_durable(path, outcome.to_json(), "outcome")


def read_outcome(root: Path, run_id: str, nonce: str = "") -> Outcome | None:
    """The launcher. None when the run left no record (finished, crashed) or it is unreadable;
    a record that is not ours (wrong run id or nonce, malformed) counts as none."""
    raw = _read_record(outcome_path(root, run_id))
    if (not isinstance(raw, dict) or raw.get("run_id") != run_id or raw.get("kind") not in ("preempt", "terminate")
            or not isinstance(raw.get("step"), int) or not isinstance(raw.get("committed"), bool)
            or raw.get("nonce", "") != nonce):
        return None
    return Outcome(run_id, raw["kind"], raw["step"], raw["committed"], str(raw.get("error") or ""), nonce)


@dataclass(frozen=True)
class LastRun:
    """What the launcher keeps about the previous run of a job (same Slurm job id, or the same
    local session), so the next restart can apply the no-progress guard without reading the event
    log. Written atomically by the first node's launcher after each run."""

    job_key: str
    run_id: str
    kind: str
    action: str
    progressed: bool
    latest: int | None = None
    lost_steps: int | None = None
    nonce: str = ""  # the launch that wrote it

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()


def last_run_path(root: Path, job_key: str) -> Path:
    return outcome_path(root, f"{job_key}.last").with_name(f"{job_key}.last-run.json")


def write_last_run(root: Path, record: LastRun) -> None:
    from .checkpoint.fsio import makedirs, write_durable

    path = last_run_path(root, record.job_key)
    makedirs(path.parent, 0o755)
    write_durable(path, record.to_json(), "last-run")


def read_last_run(root: Path, job_key: str, nonce: str = "") -> LastRun | None:
    """None when there is none, or it is unreadable or not this job's launch's (`nonce`)."""
    raw = _read_record(last_run_path(root, job_key))
    if (not isinstance(raw, dict) or raw.get("job_key") != job_key or not isinstance(raw.get("progressed"), bool)
            or raw.get("nonce", "") != nonce):
        return None
    latest, lost = raw.get("latest"), raw.get("lost_steps")
    return LastRun(job_key, str(raw.get("run_id", "")), str(raw.get("kind", "")), str(raw.get("action", "")),
                   raw["progressed"], latest if isinstance(latest, int) else None,
                   lost if isinstance(lost, int) else None, nonce)


def hang_path(root: Path, run_id: str) -> Path:
    return outcome_path(root, run_id).with_name(f"{run_id}.hang.json")


def write_hang(root: Path, run_id: str, record: dict[str, Any]) -> None:
    """The launcher that found a hung rank, before it kills its ranks. Atomic and durable."""
    from .checkpoint.fsio import makedirs, write_durable

    path = hang_path(root, run_id)
    makedirs(path.parent, 0o755)
    write_durable(path, json.dumps({**record, "run_id": run_id}, separators=(",", ":")).encode(), "hang record")


def read_hang(root: Path, run_id: str, nonce: str = "") -> dict[str, Any] | None:
    """Another node's hang verdict on this run, or None (none, unreadable, not this run's or
    launch's: `write_hang`'s record carries the launch's "nonce")."""
    raw = _read_record(hang_path(root, run_id))
    ok = (isinstance(raw, dict) and raw.get("run_id") == run_id and isinstance(raw.get("step"), int)
          and raw.get("nonce", "") == nonce)
    return raw if ok and isinstance(raw.get("ranks"), list) else None


def mirror_behind_path(root: Path, run_id: str) -> Path:
    return outcome_path(root, run_id).with_name(f"{run_id}.mirror-behind.json")


def write_mirror_behind(root: Path, run_id: str, step: int | None, error: str) -> None:
    """Rank 0, at close() when the run's last committed step did not reach the mirror (it then
    exits EXIT_MIRROR_BEHIND, which torchrun reports as a plain failure): the launcher's way to
    know the run finished locally. Atomic and durable; stamped with the launch's nonce."""
    from .checkpoint.fsio import makedirs, write_durable

    path = mirror_behind_path(root, run_id)
    makedirs(path.parent, 0o755)
    body = {"run_id": run_id, "step": step, "error": error[:500], "nonce": os.environ.get(ENV_NONCE, "")}
    write_durable(path, json.dumps(body, separators=(",", ":")).encode(), "mirror-behind record")


def read_mirror_behind(root: Path, run_id: str, nonce: str = "") -> dict[str, Any] | None:
    """The launcher: rank 0's `write_mirror_behind` record of this run and launch, or None."""
    raw = _read_record(mirror_behind_path(root, run_id))
    ok = (isinstance(raw, dict) and raw.get("run_id") == run_id and raw.get("nonce", "") == nonce
          and (raw.get("step") is None or isinstance(raw.get("step"), int)))
    return raw if ok else None


def _read_record(path: Path) -> Any:
    """The JSON of a small record file under `<root>/.runs/`, or None when it is missing,
    unreadable or not JSON. No symlink is followed and at most MAX_OUTCOME_BYTES + 1 bytes are
    read (a larger file fails to parse)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        return json.loads(os.read(fd, MAX_OUTCOME_BYTES + 1))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


RECORDS_YOUNG_S = 3600.0  # a record this young is never pruned (another node may be writing it)
RECORDS_KEEP_RUNS = 16  # this job's newest per-run records kept (status, a post-mortem)


def plan_record_prune(entries: list[tuple[str, float]], job_key: str, now: float) -> list[str]:
    """Pure: which `.runs/` entries (name, mtime) to delete at a launch of `job_key`. Kept: every
    entry younger than RECORDS_YOUNG_S; this job's crash-loop record and node summaries; its
    RECORDS_KEEP_RUNS newest other records. Everything else is another launch's and unread
    (the launcher believes only records with its nonce)."""
    old = [(n, t) for n, t in entries if now - t >= RECORDS_YOUNG_S]
    mine = sorted(((n, t) for n, t in old if n.startswith(f"{job_key}.")), key=lambda e: e[1], reverse=True)
    keep = {n for n, _ in mine if n.endswith((".last-run.json", ".ranks.json"))}
    runs = [n for n, _ in mine if n not in keep]
    keep.update(runs[:RECORDS_KEEP_RUNS])
    return sorted(n for n, _ in old if n not in keep)


def prune_records(root: Path, job_key: str, now: float) -> int:
    """The first node's launcher, holding the root's lease, at a launch: `plan_record_prune`
    applied to `<root>/.runs/`. Best effort; returns the number removed."""
    folder = Path(root) / RUNS_DIR
    try:
        entries = [(e.name, e.stat(follow_symlinks=False).st_mtime) for e in os.scandir(folder)
                   if e.is_file(follow_symlinks=False)]
    except OSError:
        return 0
    removed = 0
    for name in plan_record_prune(entries, job_key, now):
        try:
            os.unlink(folder / name)
            removed += 1
        except OSError:
            pass
    return removed


# -- signals: the warning signal's name (submit, the launcher, every rank) and the stack-dump signal --

def read_json(path: Path) -> Any:
    """One such note's contents; None when it is absent or not (yet) JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_json(path: Path, data: Any) -> None:
    """One small note of the failure-time save's directories (a rank's pid, status or report, a
    launcher's address, a rank posted dead), written whole: a reader sees the old file or the new
    one. Several writers may post the same name (two survivors, or a rank and its launcher): each
    writes its own temporary file. Not fsynced: the notes live for one run."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def parse_signal(name: str | int | signal.Signals) -> signal.Signals:
    """`USR1`, `SIGUSR1`, `10` or a Signals member -> Signals; ValueError on anything else."""
    if isinstance(name, signal.Signals):
        return name
    if isinstance(name, int) or (isinstance(name, str) and name.isdigit()):
        return signal.Signals(int(name))
    key = name.upper()
    key = key if key.startswith("SIG") else f"SIG{key}"
    try:
        return signal.Signals[key]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}: use a name like USR1 or SIGUSR2") from None


def dump_signal(warning: signal.Signals) -> signal.Signals:
    """The signal the launcher sends for a stack dump: SIGUSR2, or SIGUSR1 when the warning signal
    is USR2 (the warning must keep meaning 'save now')."""
    return signal.SIGUSR1 if warning == signal.SIGUSR2 else signal.SIGUSR2

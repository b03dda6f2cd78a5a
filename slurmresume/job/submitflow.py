"""`submit`'s workflow, from a JobSpec to one typed result: refuse what cannot work before anything
is created (the root's owner, the texts, the pre-flight checks, a step folder as root, a root
that cannot hold one more checkpoint), prepare `--resume-from`, then run here (`--local`),
preview (`--dry-run`) or submit, claim the root and log the submission. The CLI parses the
options into the JobSpec and `SubmitFlags`, calls `run_submit` and renders what it returns.

The checks that read the script, the cluster and the root's history live in roles above this
one (tools/, train/): `run_submit` takes them as a `SubmitChecks` (tools.preflight.submit_checks
builds it), so that job/ imports neither."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ConfigError
from ..events import EV_EXIT_AFTER_SAVE, EV_STARTED, EV_SUBMITTED
from .config import JobSpec, check_text

if TYPE_CHECKING:
    from .submit import Submitted


@dataclass(frozen=True)
class SubmitFlags:
    """The `submit` options that steer the command, not the job: where it runs, what it prints,
    where the run resumes from, whose root it may take."""

    local: bool = False
    dry_run: bool = False
    json_out: bool = False
    resume_from: str | None = None
    branch: Path | None = None
    discard_newer: bool = False
    takeover: bool = False
    no_script_check: bool = False
    shared_root: bool = False


class Preflight(Protocol):
    def __call__(self, spec: JobSpec, *, strict_script: bool, shared_root: bool, resume_from: str | None,
                 branch: Path | None, slurm: bool, script_imports: bool) -> list[str]: ...


class PrepareResume(Protocol):
    def __call__(self, root: Path, resume_from: str, *, branch: Path | None, discard_newer: bool) -> Path: ...


@dataclass(frozen=True)
class SubmitChecks:
    """The steps of the workflow that live above job/: `preflight` raises ConfigError for the first
    refusal and returns warnings (tools.preflight.preflight); `prepare_resume` makes the root a
    `--resume-from` run continues in (tools.lineage); `check_root` raises ConfigError for a root
    that is not a writable directory with room for one more checkpoint (tools.doctor);
    `lead_warning` is the line (or None) for a --signal-lead shorter than the root's measured
    saves need (job.leadtime over the event log)."""

    preflight: Preflight
    prepare_resume: PrepareResume
    check_root: Callable[[Path], None]
    lead_warning: Callable[[Path, int], str | None]


@dataclass(frozen=True)
class LocalPreview:
    """`--local --dry-run`: the torchrun command a local run would start; nothing ran."""

    torchrun: list[str]
    ckpt_dir: Path


@dataclass(frozen=True)
class LocalRun:
    """`--local`, ended: the launcher's record (`kind`, `action`, `reason`, ...)."""

    record: dict[str, Any]
    ckpt_dir: Path


@dataclass(frozen=True)
class Interrupted:
    """`--local` stopped by Ctrl-C: the launcher's record and the line that says where it stopped."""

    record: dict[str, Any]
    line: str


@dataclass(frozen=True)
class JobPreview:
    """`--dry-run`: the sbatch script and torchrun command; nothing submitted or written."""

    sub: Submitted
    ckpt_dir: Path


@dataclass(frozen=True)
class JobSubmitted:
    """Submitted to Slurm: the job owns the root and the `submitted` event is logged."""

    sub: Submitted
    ckpt_dir: Path


SubmitResult = LocalPreview | LocalRun | Interrupted | JobPreview | JobSubmitted


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Point file descriptor 1 (inherited by torchrun and the ranks) at stderr meanwhile."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def interrupted_line(root: Path, checkpoint: int | None) -> str:
    """The last line of a Ctrl-C'd local run: the step the ranks stopped at (their save on the
    interrupt, from the event log) and the newest complete checkpoint a rerun resumes from."""
    from ..events import read_events

    events = read_events(root)[-200:]
    starts = [i for i, e in enumerate(events) if e.get("event") == EV_STARTED]
    run = events[starts[-1]:] if starts else []
    saved = [e["step"] for e in run if e.get("event") == EV_EXIT_AFTER_SAVE and isinstance(e.get("step"), int)]
    ckpt = f"checkpoint step {checkpoint}" if checkpoint is not None else "no checkpoint yet"
    where = f"interrupted at step {saved[-1]}" if saved else "interrupted without a save"
    return f"{where} ({ckpt}): the same command resumes from there"


def run_submit(spec: JobSpec, flags: SubmitFlags, checks: SubmitChecks, warn: Callable[[str], None]) -> SubmitResult:
    """Refuse what cannot work before anything is created, then run here (`flags.local`), preview
    (`flags.dry_run`) or submit. `warn` gets each warning (one line, no prefix) when it is known,
    before the run starts. With `flags.json_out` a local run's output goes to stderr, so that
    stdout is left for the one JSON document."""
    from .. import ownership
    from ..checkpoint.layout import refuse_step_dir

    if not flags.dry_run:  # one owner per root: refused before anything is created, moved or submitted
        ownership.check_free(spec.ckpt_dir, takeover=flags.takeover)
    # The same checks as every other value, before prepare_resume creates or deletes anything.
    check_text("--resume-from", flags.resume_from or "")
    check_text("--branch", str(flags.branch or ""))
    # --dry-run previews on any machine: the nodes' file system is judged when it is submitted
    for line in checks.preflight(spec, strict_script=not flags.local and not flags.no_script_check,
                                 shared_root=flags.shared_root or flags.dry_run, resume_from=flags.resume_from,
                                 branch=flags.branch, slurm=not flags.local, script_imports=not flags.no_script_check):
        warn(line)
    if flags.resume_from is not None and not flags.dry_run:
        spec = replace(spec, ckpt_dir=checks.prepare_resume(spec.ckpt_dir, flags.resume_from, branch=flags.branch,
                                                            discard_newer=flags.discard_newer))
    elif flags.branch is not None or flags.discard_newer:
        raise ConfigError("--branch and --discard-newer only make sense with --resume-from STEP")
    lead = checks.lead_warning(spec.ckpt_dir, spec.signal_lead)
    if lead:
        warn(lead)
    refuse_step_dir(Path(spec.ckpt_dir).expanduser().absolute(), "submit", "--ckpt-dir")  # not only on the node
    if not flags.dry_run:
        checks.check_root(spec.ckpt_dir)  # before any training
    if flags.local:
        return _local(spec, flags)
    return _slurm(spec, flags)


def _local(spec: JobSpec, flags: SubmitFlags) -> LocalPreview | LocalRun | Interrupted:
    from .node import run_local, torchrun_command

    if flags.dry_run:
        return LocalPreview(torchrun_command(spec, nnodes=1, endpoint=None, rdzv_id="local"), spec.ckpt_dir)
    with stdout_to_stderr() if flags.json_out else contextlib.nullcontext():
        record = run_local(spec, takeover=flags.takeover)
    if record.get("kind") == "interrupted":  # Ctrl-C: `submit --local && next` must not go on
        return Interrupted(record, interrupted_line(spec.ckpt_dir, record.get("step")))
    return LocalRun(record, spec.ckpt_dir)


def _slurm(spec: JobSpec, flags: SubmitFlags) -> JobPreview | JobSubmitted:
    from ..events import append_event
    from . import submit as launch

    if flags.dry_run:
        return JobPreview(launch.preview(spec), spec.ckpt_dir)
    sub = launch.submit(spec)
    launch.claim_root(spec, sub.job_id, takeover=flags.takeover)
    append_event(spec.ckpt_dir, EV_SUBMITTED, job=sub.job_id, job_id=sub.job_id, script=str(spec.script),
                 nodes=spec.nodes, procs=spec.procs, signal_lead=spec.signal_lead, log_dir=str(sub.log_dir))
    return JobSubmitted(sub, spec.ckpt_dir)

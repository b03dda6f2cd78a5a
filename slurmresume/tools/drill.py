"""`slurmresume drill`: prove a script resumes exactly, before spending cluster hours.

Runs the script once uninterrupted and once with N warning signals injected at seeded random
steps (through the real launcher, torchrun and signal relay, in local mode), then compares the
final checkpoints of both runs tensor by tensor and value by value.

Both runs also save their first step (`ENV_DRILL_FIRST_SAVE`), before any warning: what differs
between the runs already there is not a resume failure. An RNG stream that differs there is
"never seeded" (reported, not failed); other state that differs there is run-to-run
non-determinism (failed, and said so). Differences are listed causes first (compare.py).
"""

from __future__ import annotations

import os
import random
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..contract import (
    ENV_DRILL_AT,
    ENV_DRILL_FIRST_SAVE,
    ENV_DRILL_HANG,
    ENV_DRILL_RECORD,
    ENV_MIRROR,
)
from ..errors import CheckpointError, ConfigError
from ..events import (
    EV_EXIT_AFTER_SAVE,
    EV_HANG,
    EV_REQUEUED,
    EV_RESUMED,
    EV_ROOT_CONFLICT,
    EV_RUN_ENDED,
    EV_SAVE_COMMITTED,
    read_events,
)
from ..job.config import JobSpec
from ..job.hang import HangBudgets
from ..job.node import run_local
from ..storage import BucketRoot, DirRoot
from .compare import Difference, compare_checkpoints, culprits, explain
from .drillcheck import (
    MetricDifference,
    first_metric_difference,
    metric_streams,
    name_unadvanced,
    partial_epoch_note,
    reference_steps,
    resumption_problems,
    run_facts,
    unadvanced_samplers,
)

# A hang drill's script is short and its steps are measured: a 5 s floor instead of 600 s keeps
# each hang's detection within seconds; start-up and save keep generous budgets (no false
# positives on a loaded machine). A warning drill keeps the default budgets.
DRILL_BUDGETS = HangBudgets(floor_s=5.0, startup_s=120.0, save_floor_s=30.0)
HANG_SPACING = 6  # steps between injected hangs: each restart's warm-up (3 steps) is judged by start-up

# The drill marks the directories it creates, and deletes only the two run roots inside a marked
# one: a --workdir the user pointed at their own files is refused, never wiped.
WORKDIR_MARK = ".slurmresume-drill"
RUN_DIRS = ("uninterrupted", "preempted")
RECORDS = "steps"  # each run's step records (train/steprecord.py), one folder per run root


@dataclass
class DrillReport:
    steps: int
    planned: list[int]
    preemptions: int  # warnings that ended in a committed save and a restart
    saved_steps: list[int]
    reference: Path
    resumed: Path
    differences: list[Difference] = field(default_factory=list)
    first_checkpoints: tuple[Path, Path] | None = None  # both runs' first step, before any warning
    hangs_planned: list[tuple[int, int]] = field(default_factory=list)  # (rank, step) per attempt
    hangs: list[dict[str, Any]] = field(default_factory=list)  # the `hang` events of the drill run
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # `resumed` events: seconds from the kill to the first step
    hang_problems: list[str] = field(default_factory=list)  # why a hang's proof is missing
    resume_problems: list[str] = field(default_factory=list)  # restarts that did not resume (drillcheck)
    metric_difference: MetricDifference | None = None  # the first step + key whose metrics= differ
    notes: list[str] = field(default_factory=list)  # what was not compared, and why (not failures)
    workdir: Path | None = None  # where both runs are (PASS says so, with the next command)
    world: int = 1
    mirror: str | None = None  # drill --mirror: the scratch prefix both runs mirrored to

    @property
    def missed(self) -> int:
        """Planned warnings that did not end in a save and a restart (the proof is weaker)."""
        return max(0, len(self.planned) - self.preemptions)

    @property
    def ok(self) -> bool:
        if self.resume_problems or self.metric_difference is not None:
            return False
        if self.hangs_planned:
            return not culprits(self.differences) and not self.hang_problems
        return not culprits(self.differences) and self.preemptions > 0 and self.missed == 0

    def hang_json(self) -> dict[str, Any] | None:
        if not self.hangs_planned:
            return None
        return {"planned": [{"rank": r, "step": s} for r, s in self.hangs_planned], "detected": self.hangs,
                "resumed": self.recoveries, "problems": self.hang_problems}


def pick_steps(total: int, n: int, seed: int) -> list[int]:
    """n distinct steps in [1, total-1], reproducible from the seed."""
    if total < 2:
        return []
    return sorted(random.Random(seed).sample(range(1, total), min(n, total - 1)))


def pick_hangs(total: int, n: int, seed: int, world: int, warmup: int) -> list[tuple[int, int]]:
    """n (rank, step) pairs, reproducible from the seed: steps after the warm-up, HANG_SPACING
    apart (each restart measures its steps afresh), before the last step."""
    rnd = random.Random(seed)
    out: list[tuple[int, int]] = []
    step = warmup + 2
    for _ in range(n):
        if step >= total:
            break
        at = step + rnd.randrange(0, 3)
        if at >= total:
            break
        out.append((rnd.randrange(world), at))
        step = at + HANG_SPACING
    return out


SCRATCH_PREFIX = "slurmresume-drill"


def scratch_mirror(url: str, token: str) -> str:
    """drill --mirror s3://BUCKET/PREFIX: the runs mirror to a scratch prefix in the same bucket,
    beside PREFIX and never under it (PREFIX may be a real run's: it must stay byte-for-byte)."""
    from ..storage.s3 import parse_s3_url

    return f"s3://{parse_s3_url(url).bucket}/{SCRATCH_PREFIX}/{token}"


def run_drill(spec: JobSpec, *, preemptions: int, seed: int, workdir: Path,
              ignore_keys: tuple[str, ...] = (), hangs: int = 0, mirror: str | None = None) -> DrillReport:
    """Both runs under `workdir` (see `prepare_workdir`), and nowhere else: no mirror (a script
    that passes its own `Checkpointer(mirror=...)` still uses it) unless `mirror` names a scratch
    prefix (see `scratch_mirror`): then each run mirrors to its own folder under it, and the
    preempted run's final step must be on the bucket. Raises CheckpointError when a run
    leaves no final checkpoint (the script must save at its end). `hangs` > 0: a hang drill
    (no warnings): each planned hang must be detected, dumped and restarted in the allocation."""
    prepare_workdir(workdir)
    ref_root, drill_root = (workdir / name for name in RUN_DIRS)
    ref_rec, drill_rec = (workdir / RECORDS / name for name in RUN_DIRS)
    # hermetic: both runs live under `workdir` alone; the mirror of the configuration
    # ([tool.slurmresume], slurmresume.toml) or of $SLURMRESUME_MIRROR is the real run's, never the drill's
    spec = replace(spec, mirror=None)
    first = {ENV_DRILL_FIRST_SAVE: "1", ENV_MIRROR: ""}
    ref_mirror, drill_mirror = (f"{mirror}/{name}" if mirror else None for name in RUN_DIRS)
    if hangs and spec.hang_budgets == HangBudgets():
        spec = replace(spec, hang_budgets=DRILL_BUDGETS)
    _run(replace(spec, ckpt_dir=ref_root, max_requeues=preemptions + 2, max_failures=0, mirror=ref_mirror),
         {**first, ENV_DRILL_RECORD: str(ref_rec)})
    ref = DirRoot(ref_root).latest()
    if ref is None:
        raise CheckpointError(_no_checkpoint("uninterrupted", ref_root, spec.script))
    if preemptions >= ref.step:  # each warning needs its own step before the last
        raise ConfigError(f"--preemptions {preemptions} needs at least {preemptions + 1} steps, and the script ran "
                          f"{ref.step}: lower --preemptions or run more steps")
    planned = pick_steps(ref.step, preemptions, seed)
    hang_plan = pick_hangs(ref.step, hangs, seed, spec.procs * spec.nodes, spec.budgets.warmup_steps)
    if hangs and len(hang_plan) < hangs:
        raise ConfigError(f"--hang {hangs} needs more steps: the script ran {ref.step} steps, and hangs are placed "
                          f"after {spec.budgets.warmup_steps + 2} steps and {HANG_SPACING} apart; run more steps")
    env = {**first, ENV_DRILL_AT: ",".join(map(str, planned)), ENV_DRILL_RECORD: str(drill_rec)}
    if hang_plan:
        env[ENV_DRILL_HANG] = ",".join(f"{r}:{s}" for r, s in hang_plan)
    try:
        _run(replace(spec, ckpt_dir=drill_root, max_requeues=preemptions + 2, max_failures=0,
                     max_hangs=len(hang_plan) + 1, mirror=drill_mirror), env)
    except SystemExit as exc:
        if not hang_plan:
            raise
        report = DrillReport(ref.step, planned, 0, [], ref.path, drill_root, hangs_planned=hang_plan)
        _check_hangs(report, drill_root, spec.procs * spec.nodes)
        report.hang_problems.insert(0, f"the drill run stopped: {exc}")
        return report
    final = DirRoot(drill_root).latest()
    if final is None:
        raise CheckpointError(_no_checkpoint("preempted", drill_root, spec.script))
    events = read_events(drill_root)
    saved = [e["step"] for e in events if e["event"] == EV_EXIT_AFTER_SAVE and e.get("kind") == "preempt"]
    restarts = sum(1 for e in events if e["event"] == EV_REQUEUED)
    world = spec.procs * spec.nodes
    report = DrillReport(ref.step, planned, restarts, saved, ref.path, final.path, hangs_planned=hang_plan,
                         workdir=workdir, world=world, mirror=mirror)
    if drill_mirror:
        report.resume_problems += _mirror_problems(drill_mirror, final.step)
    if hang_plan:
        _check_hangs(report, drill_root, world)
    report.resume_problems = resumption_problems(run_facts(drill_root, drill_rec), reference_steps(ref_rec),
                                                 framework_of(spec.script))
    resumed_streams = metric_streams(drill_rec, world)
    report.metric_difference = first_metric_difference(metric_streams(ref_rec, world), resumed_streams, ignore_keys)
    report.notes = [note for note in [partial_epoch_note(resumed_streams)] if note]
    if final.step != ref.step:
        report.differences = [Difference(0, "step", f"uninterrupted run ended at step {ref.step}, "
                                                    f"preempted run at {final.step}")]
        return report
    report.first_checkpoints = _first_checkpoints(ref_root, drill_root)
    at_first = compare_checkpoints(*report.first_checkpoints, ignore_keys) if report.first_checkpoints else []
    report.differences = compare_checkpoints(ref.path, final.path, ignore_keys)
    explain(report.differences, unseeded={d.key for d in at_first if d.cause == "rng"},
            first={d.top for d in at_first if d.cause != "rng"}, world=world)
    name_unadvanced(report.differences, unadvanced_samplers(ref.path, ref.step), ref.step)
    return report


def _mirror_problems(url: str, step: int) -> list[str]:
    """The preempted run's last step must have reached its mirror, complete and verified."""
    from ..mirror import parse_s3_url

    newest = BucketRoot(parse_s3_url(url)).latest(verify=True)
    if newest is None or newest.step != step or not newest.verified:
        found = "nothing complete" if newest is None else f"step {newest.step}"
        return [f"the mirror {url} holds {found}, not the run's last step {step} verified"]
    return []


class DrillInterrupted(Exception):
    """Ctrl-C (SIGINT) stopped a run of the drill: there is no verdict."""


def _run(spec: JobSpec, env: dict[str, str]) -> None:
    """One drill run through the local launcher; DrillInterrupted when it was stopped by Ctrl-C
    (the launcher saved and stopped: what follows would judge a run the user cut short)."""
    try:
        result = run_local(spec, env=env)
    except KeyboardInterrupt:  # a second Ctrl-C
        raise DrillInterrupted() from None
    if result.get("kind") == "interrupted":
        raise DrillInterrupted()


def _check_hangs(report: DrillReport, root: Path, world: int) -> None:
    """Each planned hang: a `hang` event naming that rank, a dump file for every rank (the hung
    rank's showing the frame it hung in), an in-allocation restart (no requeue) that resumed."""
    events = read_events(root)
    report.hangs = [e for e in events if e["event"] == EV_HANG]
    report.recoveries = [e for e in events if e["event"] == EV_RESUMED and e.get("cause") != "requeue"]
    problems = report.hang_problems
    if len(report.hangs) != len(report.hangs_planned):
        problems.append(f"{len(report.hangs_planned)} hang(s) injected, {len(report.hangs)} detected")
    for (rank, step), event in zip(report.hangs_planned, report.hangs, strict=False):
        if rank not in (event.get("ranks") or []):
            problems.append(f"the hang of rank {rank} at step {step} was reported for rank(s) {event.get('ranks')}")
        folder = Path(str(event.get("dump_dir", "")))
        missing = [r for r in range(world) if not (folder / f"rank-{r}.txt").is_file()]
        if missing:
            problems.append(f"no stack dump for rank(s) {missing} in {folder}")
        elif "drill_hang_here" not in (folder / f"rank-{rank}.txt").read_text(errors="replace"):
            problems.append(f"the dump of rank {rank} ({folder}) does not show the frame it hung in")
    if any(e["event"] == EV_REQUEUED for e in events):
        problems.append("the run was requeued: a hang must restart inside the allocation")
    retries = [e for e in events if e["event"] == EV_RUN_ENDED and e.get("outcome") == "hung"]
    if sum(1 for e in retries if e.get("action") == "retry") != len(report.hangs_planned):
        problems.append("not every hang was followed by an in-allocation restart")
    if len([e for e in report.recoveries if e.get("cause") == "hang"]) != len(report.hangs_planned):
        problems.append("not every restart after a hang reached its first step")


def prepare_workdir(workdir: Path) -> None:
    """Make `workdir` ready for a drill without deleting anything the drill did not create.

    A missing or empty directory is created and marked; a directory marked by an earlier drill
    loses only its two run roots (`uninterrupted/`, `preempted/`); anything else (a non-empty
    directory without the mark, a file) is refused with ConfigError before anything changes."""
    if workdir.is_symlink() or (workdir.exists() and not workdir.is_dir()):
        raise ConfigError(f"--workdir {workdir} is not a directory: choose a new directory for the drill")
    if workdir.is_dir():
        marked = (workdir / WORKDIR_MARK).is_file()
        if not marked and any(os.scandir(workdir)):
            raise ConfigError(f"--workdir {workdir} is not empty and was not created by a drill: refusing to "
                              "delete its contents; choose a new or empty directory")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / WORKDIR_MARK).write_text("created by `slurmresume drill`; its run directories are replaced "
                                        "by the next drill in this directory\n")
    for name in (*RUN_DIRS, RECORDS):
        path = workdir / name
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)


def _first_checkpoints(ref_root: Path, drill_root: Path) -> tuple[Path, Path] | None:
    """The step directories of both runs' first save (made before any warning), when both still
    exist at the same step (retention may have deleted them)."""
    dirs = []
    for root in (ref_root, drill_root):
        steps = [e["step"] for e in read_events(root) if e["event"] == EV_SAVE_COMMITTED
                 and e.get("reason") == "drill_first" and isinstance(e.get("step"), int)]
        info = DirRoot(root).latest(max_step=min(steps)) if steps else None
        if info is None or info.step != min(steps):
            return None
        dirs.append(info.path)
    return dirs[0], dirs[1]


def _no_checkpoint(which: str, root: Path, script: Path | None = None) -> str:
    """Why a run left nothing under the drill's root: the script saved elsewhere (an explicit
    Checkpointer(root=...) overriding the launcher's), its framework never got our callback,
    or it never saved."""
    conflicts = [e for e in read_events(root) if e["event"] == EV_ROOT_CONFLICT]
    if conflicts:
        return (f"the {which} run saved to {conflicts[-1].get('script_root')}, not to the drill's root {root}: "
                "the script passes its own root to Checkpointer(root=...), which overrides the launcher's "
                "$SLURMRESUME_CKPT_DIR; pass root=None (or the launcher's root) under submit/drill")
    missing = f"the {which} run left no complete checkpoint in {root}: "
    framework = framework_of(script)
    if framework:
        return missing + FRAMEWORK_FIX[framework]
    return missing + "save at the end of training (ckpt.save(step, state))"


FRAMEWORK_FIX = {
    "lightning": "pass the callback to the Trainer (pl.Trainer(callbacks=[SlurmResume()]), from "
                 "slurmresume.integrations.lightning): it restores, saves on the warning and saves the last step",
    "transformers": "pass the callback to the Trainer (Trainer(..., callbacks=[resume]) with resume = "
                    "SlurmResumeCallback() from slurmresume.integrations.transformers) and train with "
                    "trainer.train(resume_from_checkpoint=resume.resume_from(trainer))",
}


def framework_of(script: Path | None) -> str | None:
    """'lightning' or 'transformers' when the script imports that framework's Trainer (read as
    text, never run), else None."""
    try:
        text = script.read_text(errors="replace") if script is not None else ""
    except OSError:
        return None
    if re.search(r"^\s*(import|from)\s+(lightning|pytorch_lightning)\b", text, re.M):
        return "lightning"
    if re.search(r"^\s*from\s+transformers\b.*\bTrainer\b", text, re.M):
        return "transformers"
    return None

"""`slurmresume doctor`: will preemption handling work on *this* cluster, root and script?

Pure checks over text (the output of `scontrol show config` / `scontrol show partition`, the
script's source, /proc/mounts) return `Check`s; `run_doctor` gathers those texts through one
seam each (`slurm.run`, file reads) and calls them. `preflight_root` is what `submit` runs
before training starts.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.fsio import fs_type
from ..errors import ConfigError, SlurmError
from ..events import save_seconds

OK, WARN, FAIL = "ok", "warn", "fail"
EARLY_SIGNAL_S = 60  # sbatch(1): the --signal signal may come up to 60 s earlier than asked
NETWORK_FS = {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "ceph", "glusterfs", "fuse.sshfs",
              "fuse.gcsfuse", "fuse.s3fs", "fuse.juicefs", "9p"}


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail
    message: str  # what was found
    fix: str = ""  # what to change (warn / fail)


def parse_keyvalues(text: str) -> dict[str, str]:
    """`Key = value` lines (scontrol show config) and `Key=value` tokens (show partition)."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = re.match(r"^\s*([A-Za-z_]\w*)\s+=\s+(.*?)\s*$", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def parse_partitions(text: str) -> list[dict[str, str]]:
    parts: list[dict[str, str]] = []
    for tok in text.split():
        key, sep, value = tok.partition("=")
        if not sep:
            continue
        if key == "PartitionName":
            parts.append({})
        if parts:
            parts[-1][key] = value
    return parts


def _seconds(value: str) -> int | None:
    m = re.match(r"^(\d+)", value or "")
    return int(m.group(1)) if m else None


def _version(config: dict[str, str]) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", config.get("SLURM_VERSION", ""))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_config(config: dict[str, str], save_s: float | None) -> list[Check]:
    """PreemptType/Mode, the user signal at preemption, JobRequeue, ProctrackType, KillWait."""
    out = []
    ptype = config.get("PreemptType", "preempt/none")
    mode = config.get("PreemptMode", "OFF").upper()
    params = config.get("SlurmctldParameters", "") + "," + config.get("PreemptParameters", "")
    if ptype == "preempt/none" or mode.startswith("OFF"):
        out.append(Check("preemption", OK, f"{ptype}, PreemptMode={mode}: no preemption; only time limits "
                                           "and scancel end a job early"))
    elif "REQUEUE" in mode:
        out.append(Check("preemption", OK, f"{ptype}, PreemptMode={mode}: a preempted job is requeued"))
    elif "CANCEL" in mode:
        out.append(Check("preemption", FAIL, f"PreemptMode={mode}: a preempted job is cancelled, never requeued",
                         "ask the admins for PreemptMode=REQUEUE (or submit where preemption requeues)"))
    else:
        out.append(Check("preemption", WARN, f"PreemptMode={mode}: jobs are suspended or gang-scheduled, "
                                             "not signalled", "nothing to save on suspend; REQUEUE is what the tool "
                                                              "is built for"))
    preempting = ptype != "preempt/none" and not mode.startswith("OFF")
    if preempting and "send_user_signal" not in params:
        where = ("PreemptParameters=send_user_signal" if _version(config) >= (23, 2)
                 else "SlurmctldParameters=preempt_send_user_signal")
        out.append(Check("warning at preemption", WARN, "a preempted job gets SIGTERM at the start of GraceTime, "
                         "not the --signal warning: the save is best effort and the job is not self-requeued",
                         f"ask the admins for {where}"))
    elif preempting:
        out.append(Check("warning at preemption", OK, "the --signal warning is sent at preemption "
                                                      "(send_user_signal)"))
    requeue = config.get("JobRequeue", "1")
    out.append(Check("JobRequeue", OK, f"JobRequeue={requeue}" + (
        "" if requeue == "1" else ": jobs are not requeueable by default; submit passes --requeue explicitly")))
    out.append(_proctrack(config.get("ProctrackType", "")))
    kill_wait = _seconds(config.get("KillWait", "")) or 30
    if save_s is not None and kill_wait < save_s:
        out.append(Check("KillWait", WARN, f"KillWait={kill_wait} s is shorter than the measured save "
                         f"({save_s:.1f} s): after SIGTERM (time limit without warning, scancel) the best-effort "
                         "save is SIGKILLed", "rely on --signal-lead for time limits; scancel --signal USR1 "
                                              "before cancelling"))
    else:
        out.append(Check("KillWait", OK, f"KillWait={kill_wait} s between SIGTERM and SIGKILL"
                         + (f" (save takes {save_s:.1f} s)" if save_s is not None else "")))
    return out


def _proctrack(ptype: str) -> Check:
    if ptype.endswith("cgroup"):
        return Check("ProctrackType", OK, f"{ptype}: the warning reaches only the srun task (the slurmresume "
                                          "launcher), which relays it to every rank")
    if ptype.endswith(("linuxproc", "pgid")):
        return Check("ProctrackType", WARN, f"{ptype}: every process of the job gets the signal (ranks may get "
                     "it twice) and orphans can outlive the job", "prefer proctrack/cgroup; slurmresume copes, "
                                                                  "but DataLoader workers must ignore the signal")
    return Check("ProctrackType", WARN, f"{ptype or 'unknown'}: not a tracker slurmresume was tested with",
                 "test with `slurmresume submit ... && scancel --signal USR1 JOB`")


def check_partitions(parts: list[dict[str, str]], partition: str | None, lead: int,
                     save_s: float | None) -> list[Check]:
    """GraceTime of every partition a job can be preempted on, and the chosen one's MaxTime."""
    out = []
    if partition is not None:
        chosen = [p for p in parts if p.get("PartitionName") == partition]
        if not chosen:
            names = ", ".join(p.get("PartitionName", "?") for p in parts)
            return [Check("partition", FAIL, f"partition {partition!r} does not exist", f"use one of: {names}")]
    else:
        chosen = [p for p in parts if p.get("Default") == "YES"] or parts[:1]
    tiers = [int(p.get("PriorityTier", "1") or 1) for p in parts]
    need = save_s or 0.0
    for p in chosen:
        name = p.get("PartitionName", "?")
        grace = _seconds(p.get("GraceTime", "0")) or 0
        preemptable = (int(p.get("PriorityTier", "1") or 1) < max(tiers, default=1)
                       and p.get("PreemptMode", "").upper() != "OFF")
        if preemptable and grace < need + 5:
            out.append(Check(f"GraceTime ({name})", FAIL if grace == 0 else WARN,
                             f"GraceTime={grace} s on a preemptable partition; a save takes {need:.1f} s",
                             f"ask for GraceTime >= {int(2 * need) + 10} s, or submit to a partition that is not "
                             "preempted"))
        else:
            out.append(Check(f"GraceTime ({name})", OK, f"GraceTime={grace} s"
                             + ("" if preemptable else " (not preempted by a higher tier)")))
        max_time = p.get("MaxTime", "UNLIMITED")
        limit = slurm_limit_minutes(max_time)
        if limit is not None and limit * 60 <= lead:
            out.append(Check(f"MaxTime ({name})", FAIL, f"MaxTime={max_time} is not longer than --signal-lead {lead} s: "
                             "the warning would come before the job starts", "use a smaller --signal-lead"))
        elif limit is not None and limit * 60 < 2 * (lead + need):
            out.append(Check(f"MaxTime ({name})", WARN, f"MaxTime={max_time} leaves little time besides the "
                             f"--signal-lead ({lead} s) and a save ({need:.1f} s): each run trains briefly",
                             "submit to a partition with a longer MaxTime"))
        else:
            out.append(Check(f"MaxTime ({name})", OK, f"MaxTime={max_time}"))
    return out


def slurm_limit_minutes(value: str) -> int | None:
    """A partition's MaxTime in minutes; None when unlimited or not understood."""
    if value.upper() in ("UNLIMITED", "INFINITE", ""):
        return None
    from ..job.config import slurm_time_minutes

    try:
        return slurm_time_minutes(value)
    except ConfigError:
        return None


def check_version(config: dict[str, str]) -> Check:
    v = _version(config)
    text = config.get("SLURM_VERSION", "unknown")
    notes = [f"the --signal warning can come up to {EARLY_SIGNAL_S} s early (sbatch(1)); Slurm does not cap "
             "user requeues (slurmresume does: --max-requeues)"]
    if v == (0, 0):
        return Check("Slurm version", WARN, f"version {text} not recognised", "run `scontrol --version`")
    if v < (20, 11):
        return Check("Slurm version", WARN, f"Slurm {text} is older than anything slurmresume was tested with "
                     "(22.05)", "test with a drill job: scancel --signal USR1 JOB")
    if v < (23, 2):
        notes.append("PreemptParameters=send_user_signal is a fatal parse error here: use "
                     "SlurmctldParameters=preempt_send_user_signal")
    return Check("Slurm version", OK, f"Slurm {text}; " + "; ".join(notes))


def check_lead(lead: int, saves: list[float], step_s: float | None) -> Check:
    """--signal-lead must cover the slowest recent save plus a step, with margin."""
    if not saves:
        return Check("--signal-lead", OK, f"{lead} s; no save measured under this root yet (run one, then "
                                          "doctor again)")
    from ..job.leadtime import required_lead

    slow = max(saves)
    need = required_lead(slow, step_s)
    what = f"{lead} s vs slowest of the last {len(saves)} saves {slow:.1f} s"
    if lead < slow + (step_s or 0):
        return Check("--signal-lead", FAIL, what + ": the job is killed before the save commits",
                     f"submit with --signal-lead {int(need)} or more")
    if lead < need:
        return Check("--signal-lead", WARN, what + ": little margin (a slow filesystem day, one more step)",
                     f"submit with --signal-lead {int(need)}")
    return Check("--signal-lead", OK, what + " (margin x2 + a step)")


def check_script(source: str, name: str) -> list[Check]:
    """Static: a Checkpointer is made, and its own restore() and step() are called, step() inside a
    loop (scriptfacts.py: `opt.step()` is not `ckpt.step()`); or an integration callback does it."""
    from .scriptfacts import CALLBACKS, script_facts

    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return [Check("script", FAIL, f"{name} does not parse: line {exc.lineno}: {exc.msg}", "fix the syntax")]
    facts = script_facts(tree, source)
    if facts.callback is not None:
        return [Check("script", OK, f"{name} uses slurmresume's {CALLBACKS[facts.callback]} callback "
                                    f"({facts.callback}), which restores and calls ckpt.step() every step")]
    out = []
    if not facts.creates:
        out.append(Check("script", FAIL, f"{name} never creates slurmresume.Checkpointer",
                         "add ckpt = slurmresume.Checkpointer(save_every=...) (see README: Adapt your script)"))
    if not facts.restores:
        out.append(Check("script: restore", FAIL, f"{name} never calls .restore(state) on its Checkpointer: a "
                                                 "requeued run starts from scratch", "step = ckpt.restore(state) before "
                                                                                     "the loop"))
    if not facts.steps:
        out.append(Check("script: step", FAIL, f"{name} never calls ckpt.step(...) (other objects' .step(), such as "
                                              "the optimizer's, do not count): the warning signal is never acted on "
                                              "and nothing is saved", "call ckpt.step(step, state) at the end of "
                                                                      "every training step"))
    elif not any(facts.steps):
        out.append(Check("script: step", WARN, f"{name} calls ckpt.step(...) only outside loops",
                         "call ckpt.step(step, state) inside the training loop, every step"))
    if not out:
        out.append(Check("script", OK, f"{name} creates a Checkpointer, restores, and calls its step() in a loop"))
    return out


def check_filesystem(path: Path, mounts: str) -> Check:
    kind, mnt = fs_type(path, mounts)
    if kind in NETWORK_FS or kind.startswith("fuse."):
        return Check("filesystem", WARN, f"{path} is on {kind} ({mnt}): flock may be node-local and a file written "
                     "on one node may be invisible on another for seconds", "fine for checkpoints (markers, not the "
                     "lock, decide); run `prune` from one node at a time")
    return Check("filesystem", OK, f"{path} is on {kind} ({mnt or '?'}): rename and flock are atomic")


def preflight_root(root: Path, need_bytes: int = 0) -> None:
    """`submit`, before training: the root (or its nearest existing parent) is a writable
    directory with room for one more checkpoint of `need_bytes`. ConfigError otherwise."""
    root = Path(root)
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"--ckpt-dir {root}: {probe} is a file, not a directory: choose another --ckpt-dir")
    try:
        fd, tmp = tempfile.mkstemp(prefix=".slurmresume-probe.", dir=probe)
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise ConfigError(f"--ckpt-dir {root} is not writable ({exc.strerror}): fix its permissions or choose "
                          "another --ckpt-dir") from None
    free = shutil.disk_usage(probe).free
    if need_bytes and free < need_bytes:
        raise ConfigError(f"--ckpt-dir {root} has {free / 1e9:.2f} GB free but the last checkpoint took "
                          f"{need_bytes / 1e9:.2f} GB: free space (slurmresume prune --keep 1) or choose another "
                          "--ckpt-dir")


def last_checkpoint_bytes(root: Path) -> int:
    from ..storage import DirRoot

    if not root.is_dir():
        return 0
    from ..errors import UnreadableCheckpointError

    try:
        info = DirRoot(root).latest()
    except UnreadableCheckpointError:  # a newer release's step: its size is not ours to read
        return 0
    return info.total_bytes if info is not None else 0


def measured_saves(events: list[dict[str, Any]], last: int = 16) -> tuple[list[float], float | None]:
    """Seconds of the last `last` committed saves, and seconds per step (None: unknown)."""
    from ..train.savepolicy import estimate_from_events

    secs = save_seconds(events)[-last:]
    return secs, estimate_from_events(events).step_s if events else None


def run_doctor(root: Path | None, script: Path | None, lead: int, partition: str | None) -> list[Check]:
    """Gather every check (reads only; runs `scontrol show config/partition` when Slurm is here)."""
    from ..events import read_events
    from ..slurm import run as slurm_run

    events = read_events(root) if root is not None and root.is_dir() else []
    saves, step_s = measured_saves(events)
    save_s = max(saves) if saves else None
    out: list[Check] = []
    try:
        config = parse_keyvalues(slurm_run(["scontrol", "show", "config"]).stdout)
        parts = parse_partitions(slurm_run(["scontrol", "show", "partition"]).stdout)
    except SlurmError as exc:
        out.append(Check("Slurm", WARN, f"cannot read the cluster configuration: {exc}",
                         "run doctor on a login node of the cluster"))
    else:
        out.append(check_version(config))
        out += check_config(config, save_s)
        out += check_partitions(parts, partition, lead, save_s)
    out.append(check_lead(lead, saves, step_s))
    if root is not None:
        try:
            preflight_root(root, last_checkpoint_bytes(root))
            out.append(Check("checkpoint root", OK, f"{root} is writable with room for the next checkpoint"))
        except ConfigError as exc:
            out.append(Check("checkpoint root", FAIL, str(exc).split(": ", 1)[0], str(exc).split(": ", 1)[-1]))
        try:
            mounts = Path("/proc/mounts").read_text()
        except OSError:
            mounts = ""
        out.append(check_filesystem(root if root.exists() else root.parent, mounts))
    if script is not None:
        try:
            source = script.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read script {script}: {exc}") from None
        out += check_script(source, script.name)
    return out

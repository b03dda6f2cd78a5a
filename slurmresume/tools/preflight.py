"""Pre-flight: what `submit` (Slurm, --dry-run, --local) and `drill` refuse before anything is
queued or written, because it could only fail on the node, after the queue wait.

Each check is a pure function over what the command already knows (the job spec, the script's
source, /proc/mounts text, whether a module can be imported) returning one line or None;
`preflight` gathers the texts through one seam each and raises the first refusal as a
ConfigError (one line, exit 1). Nothing here writes. `submit_checks` hands `preflight`, the lead
warning, the root's room and tools.lineage's `prepare_resume` (which writes) to `submit`'s
workflow, job.submitflow.
"""

from __future__ import annotations

import importlib
import signal as _signal
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint.fsio import fs_type
from ..contract import parse_signal
from ..errors import ConfigError
from ..job.config import JobSpec, slurm_time_seconds
from .doctor import FAIL, check_script, slurm_limit_minutes

if TYPE_CHECKING:
    from ..job.submitflow import SubmitChecks

# Memory and single-host block file systems: another node never sees what is written there.
MEMORY_FS = {"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"}
LOCAL_FS = {"ext2", "ext3", "ext4", "xfs", "btrfs", "f2fs", "overlay", "zfs", "vfat", "exfat"}
# torchrun's agent handles TERM/INT/HUP/QUIT itself (it stops the workers); Slurm sends TERM for
# scancel and at the time limit, which slurmresume reads as "cancel": no requeue.
_RESERVED = {
    _signal.SIGTERM: "TERM is what Slurm sends on scancel and at the time limit; slurmresume reads it as a cancel "
                     "(best-effort save, no requeue)",
    _signal.SIGINT: "torchrun's agent stops the workers on INT",
    _signal.SIGHUP: "torchrun's agent stops the workers on HUP",
    _signal.SIGQUIT: "torchrun's agent stops the workers on QUIT",
}
_UNCATCHABLE = {_signal.SIGKILL, _signal.SIGSTOP}


def signal_problem(value: str) -> str | None:
    """Pure: why the warning signal `value` ("USR1", "B:SIGTERM", "9") cannot warn a run, or None."""
    try:
        sig = parse_signal(value.removeprefix("B:"))
    except ValueError:
        return None  # JobSpec names the bad value
    if sig in _UNCATCHABLE:
        return (f"--signal {value}: {sig.name} cannot be caught, so no process can save on it: "
                "use USR1 (the default) or USR2")
    if sig in _RESERVED:
        return f"--signal {value}: {_RESERVED[sig]}: use USR1 (the default) or USR2"
    return None


def script_problem(source: str, name: str, *, strict: bool) -> str | None:
    """Pure: the first reason the script cannot run or cannot resume, or None.

    A syntax error is always a refusal. A script that never calls restore() or ckpt.step()
    (doctor's static checks) is a refusal only when `strict` (a Slurm submission: the queue
    wait is what it would cost); a script that uses a framework callback
    (slurmresume.integrations) restores and steps through it and is not judged."""
    fails = [c for c in check_script(source, name) if c.status == FAIL]
    syntax = next((c for c in fails if c.fix == "fix the syntax"), None)
    if syntax is not None:
        return f"{syntax.message}: fix the script (python -m py_compile {name})"
    if not strict or "slurmresume.integrations" in source:
        return None
    for c in fails:
        if c.name in ("script: restore", "script: step"):
            return (f"{c.message}; {c.fix} (see `slurmresume doctor {name}`; if a module it imports does this, "
                    "pass --no-script-check)")
    return None


def script_warning(source: str, name: str) -> str | None:
    """Pure: the restore()/step() problem as a warning, for runs here (--local, drill) that
    the runtime checks judge within seconds anyway."""
    if "slurmresume.integrations" in source:
        return None
    for c in check_script(source, name):
        if c.status == FAIL and c.name in ("script: restore", "script: step"):
            return f"{c.message} (see `slurmresume doctor {name}`)"
    return None


def root_problem(root: Path, nodes: int, mounts: str, *, shared_root: bool) -> str | None:
    """Pure: a multi-node root on a file system only one node sees (memory or a local disk)."""
    if nodes <= 1 or shared_root:
        return None
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    kind, mnt = fs_type(probe, mounts)
    if kind in MEMORY_FS or kind in LOCAL_FS:
        return (f"--ckpt-dir {root} is on {kind} ({mnt}), which only one node sees, but --nodes {nodes} needs a "
                "root every node writes to: choose one on a shared file system (NFS, Lustre, GPFS), or pass "
                "--shared-root if every node really mounts this same path")
    return None


def max_time_problem(time: str | None, partition: str | None, parts: list[dict[str, str]]) -> str | None:
    """Pure: --time over the MaxTime of the partition (or of every one in a comma list; the
    cluster's default one when none is named), read from `scontrol show partition`: such a job
    pends forever (or sbatch refuses it). Partitions the text does not show are not judged."""
    if time is None:
        return None
    names = partition.split(",") if partition else None
    chosen = [p for p in parts if (p.get("PartitionName") in names if names else p.get("Default") == "YES")]
    limits = [(p.get("PartitionName", "?"), p.get("MaxTime", ""), slurm_limit_minutes(p.get("MaxTime", "")))
              for p in chosen]
    if not limits or any(m is None or slurm_time_seconds(time) <= m * 60 for _, _, m in limits):
        return None
    name, text, _ = limits[0]
    return (f"--time {time} is over the MaxTime of partition {name} ({text}): the job would wait in the queue "
            f"forever: give --time {text} or less, or a partition with a longer MaxTime (slurmresume doctor -p NAME "
            "shows it)")


def lead_share_warning(time: str | None, lead: int) -> str | None:
    """Pure: a --signal-lead over a third of --time leaves each allocation little training."""
    if time is None:
        return None
    secs = slurm_time_seconds(time)
    if 3 * lead <= secs:
        return None
    return (f"--signal-lead {lead} s is over a third of --time {time} ({secs} s): each allocation trains at most "
            f"{secs - lead} s before the warning: give a longer --time (or a shorter --signal-lead if saves are quick)")


def mirror_problem(mirror: str | None, importable: bool) -> str | None:
    """Pure: --mirror without the client that uploads to it."""
    if mirror is not None and not importable:
        return (f"--mirror {mirror} needs boto3, which this python cannot import: "
                "pip install 'slurmresume[s3]' (on the nodes' python too)")
    return None


def resume_problem(root: Path, resume_from: str | None, branch: Path | None) -> str | None:
    """`--resume-from` names a complete step and `--branch` a new (absent or empty) directory.
    Reads only (markers, manifests); the same checks prepare_resume makes before it writes."""
    if resume_from is None:
        return None
    from ..checkpoint.layout import step_dir_name
    from ..checkpoint.store import inspect_dir
    from .lineage import parse_resume_from

    src_root, step = parse_resume_from(resume_from, root)
    path = src_root / step_dir_name(step)
    if not path.is_dir():
        return f"--resume-from {resume_from}: {path} does not exist: list the steps with `slurmresume status -d {src_root}`"
    info = inspect_dir(step, path)
    if not info.complete:
        return f"--resume-from {resume_from}: cannot resume from {info.path}: {info.problem}"
    if branch is not None:
        new = branch.expanduser().absolute()
        if new == src_root:
            return "--branch must name a new checkpoint root, not the current one"
        if new.exists() and (not new.is_dir() or any(new.iterdir())):
            return f"--branch {new} exists and is not empty: choose a new directory"
    return None


def _mounts() -> str:
    try:
        return Path("/proc/mounts").read_text()
    except OSError:
        return ""


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _partitions() -> list[dict[str, str]]:
    """`scontrol show partition`, parsed; empty where Slurm is not here or does not answer."""
    import shutil

    from ..errors import SlurmError
    from ..slurm import run as slurm_run
    from .doctor import parse_partitions

    if shutil.which("scontrol") is None:
        return []
    try:
        return parse_partitions(slurm_run(["scontrol", "show", "partition"], timeout=15.0).stdout)
    except SlurmError:
        return []


def _read_script(script: Path) -> str:
    try:
        return script.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the training script {script}: {exc}") from None


def preflight(spec: JobSpec, *, strict_script: bool, shared_root: bool = False, resume_from: str | None = None,
              branch: Path | None = None, slurm: bool = False, script_imports: bool = True) -> list[str]:
    """Raise ConfigError for the first refusal; return warnings (one line each) to print.
    `strict_script`: a Slurm submission (or its --dry-run), where a script that never
    restores or steps is refused rather than warned about. `slurm`: a Slurm submission (or its
    --dry-run): also --time against the partition's MaxTime and the lead, and what the nodes'
    python imports (the script's own imports too unless not `script_imports`), last: the slowest."""
    source = _read_script(spec.script)
    problems = [
        script_problem(source, spec.script.name, strict=strict_script),
        signal_problem(spec.signal),
        mirror_problem(spec.mirror, spec.mirror is None or _importable("boto3")),
        root_problem(spec.ckpt_dir, spec.nodes, _mounts(), shared_root=shared_root),
        resume_problem(spec.ckpt_dir, resume_from, branch),
    ]
    if slurm and spec.time is not None:
        problems.append(max_time_problem(spec.time, spec.partition, _partitions()))
    first = next((p for p in problems if p), None)
    if first:
        raise ConfigError(first)
    warnings = [None if strict_script else script_warning(source, spec.script.name)]
    if slurm:
        from .nodeimports import import_problem
        from .nodeimports import script_imports as imports_of

        warnings.append(lead_share_warning(spec.time, spec.signal_lead))
        refusal, warning = import_problem(spec.python, spec.script, imports_of(source) if script_imports else [],
                                          setup=bool(spec.setup))
        if refusal:
            raise ConfigError(refusal)
        warnings.append(warning)
    return [w for w in warnings if w]


def lead_warning(root: Path, lead: int) -> str | None:
    """The line (without "warning: ") for a --signal-lead shorter than the measured saves under
    `root` need (job.leadtime.required_lead), else None; a warning, not a refusal: the prediction
    may be stale."""
    from ..events import read_events
    from ..job.leadtime import lead_report
    from ..job.leadtime import lead_warning as line_for
    from ..train.savepolicy import estimate_from_events
    from .doctor import last_checkpoint_bytes

    if not root.is_dir():
        return None
    events = read_events(root)
    if not events:
        return None
    return line_for(lead_report(events, lead, estimate_from_events(events).step_s, last_checkpoint_bytes(root) or None))


def _check_root(root: Path) -> None:
    from .doctor import last_checkpoint_bytes, preflight_root

    preflight_root(root, last_checkpoint_bytes(root))


def submit_checks() -> SubmitChecks:
    """The steps of `submit`'s workflow (job.submitflow.run_submit) that read the script, the
    cluster and the root's history, or prepare a --resume-from root: this module, tools.lineage,
    tools.doctor and train.savepolicy, which job/ does not import."""
    from ..job.submitflow import SubmitChecks
    from .lineage import prepare_resume

    return SubmitChecks(preflight=preflight, prepare_resume=prepare_resume, check_root=_check_root,
                        lead_warning=lead_warning)

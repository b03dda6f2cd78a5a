"""Submission: the only module that imports submitit. Job spec -> executor -> one task per node
running `NodeLauncher` (torchrun under a signal relay)."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SlurmError
from .config import JobSpec, slurm_time_minutes
from .node import NodeLauncher, torchrun_command

RELAY_MARK = "# slurmresume: relay"


def executor_parameters(spec: JobSpec) -> dict[str, Any]:
    """submitit SlurmExecutor parameters. Ours win over submitit's defaults: our signal (not its
    USR2@90), --requeue, --open-mode=append, one task per node."""
    params: dict[str, Any] = {
        "nodes": spec.nodes,
        "ntasks_per_node": 1,
        "stderr_to_stdout": True,
        "additional_parameters": {"signal": f"{spec.signal}@{spec.signal_lead}", "requeue": True},
    }
    # No --time: no #SBATCH --time line, so the partition's DefaultTime applies (an explicit None,
    # since submitit would otherwise write its own 5 minutes).
    params["time"] = slurm_time_minutes(spec.time) if spec.time is not None else None
    for key in ("partition", "account", "qos", "constraint", "mem", "cpus_per_task", "gpus_per_node"):
        value = getattr(spec, key)
        if value is not None:
            params[key] = value
    params["job_name"] = spec.job_name or f"slurmresume-{spec.script.stem}"
    params["wckey"] = None  # no submitit default: clusters with TrackWCKey may reject it (--sbatch wckey=X asks)
    if spec.setup:
        params["setup"] = list(spec.setup)
    for key, value in spec.sbatch:
        params["additional_parameters"][key.replace("-", "_")] = value if value != "" else True
    return params


def add_signal_relay(text: str, signal_name: str) -> str:
    """Run srun in the background under traps, so a signal sent to the batch shell only
    (`--signal=B:...`, `scancel --batch`) reaches the step, and the shell does not die of it."""
    lines = text.split("\n")  # what bash and sbatch call a line (str.splitlines also breaks at U+2028)
    if lines and lines[-1] == "":
        lines.pop()
    idx = next((i for i, line in enumerate(lines) if line.startswith("srun ")), None)
    if idx is None:
        raise SlurmError("submitit produced an sbatch script without an srun line: cannot add the relay")
    sig = signal_name.removeprefix("SIG")
    relay = [
        f"{RELAY_MARK}: the batch shell forwards {sig} and TERM to the step instead of dying",
        lines[idx] + " &",
        "SLURMRESUME_SRUN=$!",
        f"trap 'kill -s {sig} $SLURMRESUME_SRUN 2>/dev/null' {sig}",
        "trap 'kill -s TERM $SLURMRESUME_SRUN 2>/dev/null' TERM",
        "while true; do wait $SLURMRESUME_SRUN; rc=$?; kill -0 $SLURMRESUME_SRUN 2>/dev/null || break; done",
        "exit $rc",
    ]
    return "\n".join(lines[:idx] + relay + lines[idx + 1 :]) + "\n"


def _executor_class(preview: bool = False) -> type:
    import submitit

    class Executor(submitit.SlurmExecutor):
        warning_signal = "USR1"

        if preview:  # --dry-run prints the script on a machine without srun too
            @classmethod
            def affinity(cls) -> int:
                return 1

        def _make_submission_file_text(self, command: str, uid: str) -> str:
            return add_signal_relay(super()._make_submission_file_text(command, uid), self.warning_signal)

    return Executor


@dataclass(frozen=True)
class Submitted:
    job_id: str
    log_dir: Path
    sbatch_script: str
    torchrun: list[str]


def make_executor(spec: JobSpec, preview: bool = False) -> Any:
    """The submitit executor; `preview` (--dry-run) creates nothing on disk and needs no srun."""
    from ..checkpoint.fsio import makedirs

    if not preview:
        makedirs(spec.logs)  # no group/world write on the root or the logs, whatever the parents
    cls = _executor_class(preview)
    ex = cls(folder=str(spec.logs / "%j"), max_num_timeout=0, python=spec.python)
    ex.warning_signal = spec.warning_signal
    ex.update_parameters(**executor_parameters(spec))
    return ex


def preview(spec: JobSpec) -> Submitted:
    """The sbatch script and per-node torchrun command, without submitting (--dry-run)."""
    ex = make_executor(spec, preview=True)
    text = ex._make_submission_file_text("python -u -m submitit.core._submit <folder>", "<uid>")
    cmd = torchrun_command(spec, nnodes=spec.nodes, endpoint="<first-node>:<port from job id>",
                           rdzv_id="$SLURM_JOB_ID")
    return Submitted("", spec.logs, text, cmd)


def submit(spec: JobSpec) -> Submitted:
    from ..slurm import available

    if not available():
        raise SlurmError("no sbatch on PATH: use --local to run here, or run on a Slurm login node")
    if shutil.which("srun") is None:  # submitit needs it to build the script; checked before logs/ exists
        raise SlurmError("sbatch is on PATH but srun is not: submit from a Slurm login node (where both are), "
                         "or use --local to run here")
    ex = make_executor(spec)
    try:
        job = ex.submit(NodeLauncher(spec))
    except Exception as exc:  # submitit wraps sbatch failures in its own errors
        msg = str(exc).strip().splitlines()
        raise SlurmError(f"sbatch refused the job: {_last_meaningful(msg)}") from None
    text = Path(job.paths.submission_file).read_text() if Path(job.paths.submission_file).exists() else ""
    cmd = torchrun_command(spec, nnodes=spec.nodes, endpoint="<first-node>:<port>", rdzv_id=job.job_id)
    return Submitted(str(job.job_id), Path(str(job.paths.folder)), text, cmd)


def claim_root(spec: JobSpec, job_id: str, *, takeover: bool) -> None:
    """After sbatch: the new job owns the root from now on, pending included (its launcher renews
    the lease when it starts). When another submission won the race for the root in between, the
    new job is cancelled and the refusal raised: two jobs never write one root."""
    from .. import ownership
    from ..slurm import run as slurm_run

    try:
        ownership.acquire(spec.ckpt_dir, ownership.slurm_owner(job_id), takeover=takeover)
    except ownership.RootOwnedError:
        try:
            slurm_run(["scancel", job_id])
        except SlurmError:
            pass
        raise


def _last_meaningful(lines: list[str]) -> str:
    for line in reversed(lines):
        m = re.search(r"sbatch: error: (.*)", line)
        if m:
            return m.group(1)
    return lines[-1] if lines else "unknown error"

"""The job spec: frozen, validated once at the edge (CLI or library), then trusted everywhere."""

from __future__ import annotations

import os
import re
import sys
import unicodedata
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..contract import parse_signal, parse_snapshot_every
from ..errors import ConfigError
from .hang import HangBudgets, parse_hang_timeout

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_BAD_CATEGORIES = {"Cc", "Cf", "Zl", "Zp"}  # controls, format characters, line/paragraph separators
_SLURM_TIME = re.compile(r"^(\d+)$|^(\d+):(\d{1,2})$|^(\d+):(\d{1,2}):(\d{1,2})$|"
                         r"^(\d+)-(\d+)$|^(\d+)-(\d+):(\d{1,2})$|^(\d+)-(\d+):(\d{1,2}):(\d{1,2})$")
_NAME = re.compile(r"^[A-Za-z0-9_.,+:=@%-]+$")  # partition/account/qos/job names (commas: lists)
_MEM = re.compile(r"^\d+[KMGT]?$", re.IGNORECASE)
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9-]*$")
# Options we set ourselves: an --sbatch extra must not silently override them.
_RESERVED_SBATCH = {"signal", "requeue", "no-requeue", "open-mode", "output", "error", "nodes",
                    "ntasks-per-node", "wrap", "time", "t"}
# The option of ours that sets what a reserved key would: `--sbatch time=60` under `--time 120`
# would end the job at 60 minutes while the lead was checked against 120.
_OWN_OPTION = {"time": "--time", "t": "--time", "signal": "--signal and --signal-lead", "nodes": "--nodes"}


def check_text(what: str, value: str) -> str:
    """Refuse control characters: in an #SBATCH line a newline becomes an executed shell line.
    Besides ASCII controls this refuses C1 controls (NEL), Unicode line/paragraph separators and
    invisible format characters (BOM, bidi overrides), which some tools also treat as breaks."""
    if _CONTROL.search(value) or any(unicodedata.category(c) in _BAD_CATEGORIES for c in value):
        raise ConfigError(f"{what} contains a newline or control character ({value!r}): remove it")
    return value


def slurm_time_minutes(value: str) -> int:
    """Parse a Slurm time ("90", "1:30:00", "2-00:00:00", "MM:SS") into whole minutes (ceil)."""
    return -(-slurm_time_seconds(value) // 60)


def slurm_time_seconds(value: str) -> int:
    """Parse a Slurm time ("90" minutes, "MM:SS", "HH:MM:SS", "D-HH[:MM[:SS]]") into seconds."""
    check_text("--time", value)
    m = _SLURM_TIME.match(value.strip())
    if not m:
        raise ConfigError(f"--time {value!r} is not a Slurm time: use MINUTES, HH:MM:SS or D-HH:MM:SS")
    g = [int(x) if x is not None else None for x in m.groups()]
    if g[0] is not None:
        secs = g[0] * 60
    elif g[1] is not None:
        secs = g[1] * 60 + g[2]  # type: ignore[operator]
    elif g[3] is not None:
        secs = g[3] * 3600 + g[4] * 60 + g[5]  # type: ignore[operator]
    elif g[6] is not None:
        secs = g[6] * 86400 + g[7] * 3600  # type: ignore[operator]
    elif g[8] is not None:
        secs = g[8] * 86400 + g[9] * 3600 + g[10] * 60  # type: ignore[operator]
    else:
        secs = g[11] * 86400 + g[12] * 3600 + g[13] * 60 + g[14]  # type: ignore[operator]
    if secs <= 0:
        raise ConfigError(f"--time {value!r} must be positive")
    return secs


def split_signal(value: str, lead: int | None) -> tuple[str, int | None]:
    """sbatch's spelling `[B:]SIG[@SECONDS]` -> (signal, lead or None). A lead given both ways
    must agree (ConfigError otherwise)."""
    sig, at, secs = value.partition("@")
    if not at:
        return value, None
    if not secs.isdigit() or int(secs) < 1:
        raise ConfigError(f"--signal {value!r}: SECONDS after @ must be a whole number >= 1, e.g. USR1@300")
    if lead is not None and lead != int(secs):
        raise ConfigError(f"--signal {value} and --signal-lead {lead} disagree: give the lead once")
    return sig, int(secs)


def requeue_cap_reached(requeues_done: int, max_requeues: int | None) -> bool:
    """Pure: whether a preempted run that committed new progress may NOT be requeued again.

    The rule: by default (`max_requeues=None`) there is no cap; a
    week-long job is requeued at every warning and every time limit for as long as each run
    commits a newer step. What stops a run that goes nowhere is the launcher's no-progress guard
    (two consecutive runs without a new committed step), not a count. A cap applies only when the
    user sets `--max-requeues N` explicitly (command line or [tool.slurmresume]); then it counts
    every requeue of the job, time-limit requeues included."""
    return max_requeues is not None and requeues_done >= max_requeues


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything `submit` needs. Fields mirror the CLI options; see `slurmresume submit --help`."""

    script: Path  # the training script, run by torchrun on every node
    script_args: tuple[str, ...] = ()
    ckpt_dir: Path  # exported to the script as SLURMRESUME_CKPT_DIR; the event log lives here
    nodes: int = 1
    nproc_per_node: int | None = None  # default: gpus_per_node, else 1
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem: str | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    job_name: str | None = None
    signal: str = "USR1"  # "USR1", or "B:USR1" for delivery to the batch shell only
    signal_lead: int = 120
    max_requeues: int | None = None  # None: no cap while runs progress (see requeue_cap_reached)
    max_failures: int | None = None  # None: retry a failure while runs commit progress (decision.py)
    sbatch: tuple[tuple[str, str], ...] = ()
    setup: tuple[str, ...] = ()  # --setup LINE: shell lines of the batch script, before the launcher
    python: str = field(default_factory=lambda: sys.executable)
    rdzv_port: int | None = None
    log_dir: Path | None = None  # default: <ckpt_dir>/logs
    mirror: str | None = None  # s3://BUCKET/PREFIX: exported as SLURMRESUME_MIRROR (slurmresume/mirror/)
    hang_timeout: str = "auto"  # "auto" | "off" | SECONDS (hang.py): the step budget of the hang watch
    max_hangs: int = 3  # in-allocation restarts after a hang, per allocation (a requeue starts afresh)
    hang_startup: float | None = None  # --hang-startup SECONDS: start-up and warm-up budget (None: hang_budgets')
    hang_busy: float | None = None  # --hang-busy SECONDS: ckpt.busy() budget, at least the step budget
    hang_save: float | None = None  # --hang-save SECONDS: the save/restore budget's floor
    hang_io_rate: float | None = None  # --hang-io-rate MB/S: throughput assumed for a save/restore/pull not yet measured
    hang_budgets: HangBudgets = field(default_factory=HangBudgets)  # library/drill: every budget (the knobs win)
    snapshot_every: str = "auto"  # the memory tier's interval: "auto" | "off" | N steps (job/memroot.py)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (str, Path)):
                check_text(f"--{f.name.replace('_', '-')}", str(v))
        for a in self.script_args:
            check_text("a script argument", a)
        if self.script.is_dir():
            raise ConfigError(f"training script {self.script} is a directory: pass the path of a .py file in it")
        if not self.script.is_file():
            raise ConfigError(f"training script {self.script} not found: pass the path of a .py file")
        python = Path(self.python)
        if not python.is_file() or not os.access(python, os.X_OK):
            raise ConfigError(f"python interpreter {self.python} " + ("is not executable" if python.is_file() else
                              "not found") + ": give the path of the nodes' python, e.g. ~/venv/bin/python")
        for name in ("nodes", "signal_lead"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        parse_hang_timeout(self.hang_timeout)  # ConfigError naming the value
        try:
            parse_snapshot_every(self.snapshot_every)
        except ValueError:
            raise ConfigError(f"--snapshot-every {self.snapshot_every!r}: give auto, off (or 0) or a number of "
                              "steps") from None
        for name in ("hang_startup", "hang_busy", "hang_save", "hang_io_rate"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < float("inf")):
                unit = "MB/s" if name == "hang_io_rate" else "seconds"
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of {unit}, got {v!r}")
        for name in ("max_requeues", "max_failures", "max_hangs"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        for name in ("nproc_per_node", "gpus_per_node", "cpus_per_task"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        for name in ("partition", "account", "qos", "job_name"):
            v = getattr(self, name)
            if v is not None and not _NAME.match(v):
                raise ConfigError(f"--{name.replace('_', '-')} {v!r} has characters Slurm does not accept "
                                  "in a name: use letters, digits and - _ . , :")
        if self.constraint is not None and not re.match(r"^[A-Za-z0-9_.,&|\[\]*:()!-]+$", self.constraint):
            raise ConfigError(f"--constraint {self.constraint!r} is not a Slurm constraint expression")
        if self.mem is not None and not _MEM.match(self.mem):
            raise ConfigError(f"--mem {self.mem!r} is not a Slurm memory size: use e.g. 16G or 4000M")
        if self.time is not None and slurm_time_seconds(self.time) <= self.signal_lead:
            raise ConfigError(f"--time {self.time} is not longer than --signal-lead {self.signal_lead} s: the "
                              "warning would come as soon as the job starts; give a longer --time or a shorter "
                              "--signal-lead")
        sig = self.signal.removeprefix("B:")
        try:
            parse_signal(sig)
        except ValueError as exc:
            raise ConfigError(f"--signal {self.signal!r}: {exc}") from None
        for key, _value in self.sbatch:
            refuse_unsupported_sbatch(key)
            if not _SBATCH_KEY.match(key):
                raise ConfigError(f"--sbatch key {key!r} is not an sbatch option name (e.g. exclusive, gres)")
            if key in _RESERVED_SBATCH:
                raise ConfigError(f"--sbatch {key}=... is set by slurmresume itself: use "
                                  f"{_OWN_OPTION.get(key, 'its own option')} instead")
        if self.mirror is not None:
            from ..storage.s3 import parse_s3_url

            parse_s3_url(self.mirror)  # ConfigError naming the bad part
        for line in self.setup:  # one shell line each: a newline would smuggle in another
            check_text("--setup", line)
        gres = self.gres_gpus
        if gres is not None and self.gpus_per_node is not None and gres != self.gpus_per_node:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node} and --gres {self._gres_text} ask for different GPUs "
                              "per node: give the GPUs once")
        gpus = self.gpus_per_node or gres
        if gpus is not None and self.nproc_per_node is not None and self.nproc_per_node > gpus:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} is more than the {gpus} GPUs per node asked for: "
                              "one rank per GPU (NCCL refuses two ranks on one GPU): ask for more GPUs or fewer ranks")
        if self.rdzv_port is not None and not 1024 <= self.rdzv_port <= 65535:
            raise ConfigError(f"--rdzv-port must be in 1024..65535, got {self.rdzv_port}")

    @property
    def budgets(self) -> HangBudgets:
        """The hang watch's budgets: `hang_budgets` with --hang-timeout applied."""
        from dataclasses import replace

        enabled, seconds = parse_hang_timeout(self.hang_timeout)
        b = self.hang_budgets
        return replace(b, enabled=enabled, timeout_s=seconds,
                       startup_s=b.startup_s if self.hang_startup is None else float(self.hang_startup),
                       busy_s=b.busy_s if self.hang_busy is None else float(self.hang_busy),
                       save_floor_s=b.save_floor_s if self.hang_save is None else float(self.hang_save),
                       io_rate_mbs=b.io_rate_mbs if self.hang_io_rate is None else float(self.hang_io_rate))

    @property
    def _gres_text(self) -> str:
        return ",".join(v for k, v in self.sbatch if k == "gres")

    @property
    def gres_gpus(self) -> int | None:
        """GPUs per node that `--gres` (or `--sbatch gres=`) asks for, None when it asks for none."""
        counts = [gres_gpu_count(v) for k, v in self.sbatch if k == "gres"]
        found = [c for c in counts if c is not None]
        return sum(found) if found else None

    @property
    def procs(self) -> int:
        """Ranks per node: --nproc-per-node, else one per GPU asked for (--gpus-per-node, --gres gpu:N), else 1."""
        return self.nproc_per_node or self.gpus_per_node or self.gres_gpus or 1

    @property
    def warning_signal(self) -> str:
        return parse_signal(self.signal.removeprefix("B:")).name

    @property
    def batch_only(self) -> bool:
        return self.signal.startswith("B:")

    @property
    def logs(self) -> Path:
        return self.log_dir or self.ckpt_dir / "logs"


# Job arrays would share one checkpoint root (and one job-id-named log folder) between tasks that
# each requeue themselves; heterogeneous jobs have no single node list to run torchrun on.
_ARRAY_KEYS = {"array", "a"}
_HET_KEYS = {"hetjob", "packjob", ":"}


def refuse_unsupported_sbatch(key: str) -> None:
    """Job arrays and heterogeneous jobs are refused with one line (ConfigError)."""
    if key in _ARRAY_KEYS:
        raise ConfigError("--sbatch array=... is not supported: the tasks of an array would share one checkpoint "
                          "root and overwrite each other; submit one job per task with its own --ckpt-dir")
    if key in _HET_KEYS or key.startswith("het") or key.startswith("pack"):
        raise ConfigError(f"--sbatch {key!r}: heterogeneous jobs are not supported: slurmresume runs one torchrun "
                          "per node of a single homogeneous allocation")


def gres_gpu_count(gres: str) -> int | None:
    """Pure: the GPUs per node in an sbatch `--gres` value ("gpu:4", "gpu:a100:2,nvme:1",
    "gres/gpu", "gpu:a100"), None when it names no GPU. sbatch(1): name[[:type]:count], the count
    defaults to 1."""
    total = None
    for item in gres.split(","):
        parts = item.strip().removeprefix("gres/").split(":")
        if parts[0] != "gpu":
            continue
        count = parts[-1].split("(")[0] if len(parts) > 1 else "1"
        total = (total or 0) + (int(count) if count.isdigit() else 1)
    return total


def parse_sbatch_extras(items: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for item in items:
        check_text("--sbatch", item)
        key, sep, value = item.partition("=")
        key = key.strip().lstrip("-")
        if key.strip() == ":" or key.startswith(":"):
            refuse_unsupported_sbatch(":")
        if not key:
            raise ConfigError(f"--sbatch {item!r} must look like KEY=VALUE or KEY")
        out.append((key, value if sep else ""))
    return tuple(out)


_INT_KEYS = {"nodes", "nproc_per_node", "gpus_per_node", "cpus_per_task", "signal_lead", "max_requeues",
             "max_failures", "max_hangs", "rdzv_port"}
_STR_KEYS = {"ckpt_dir", "mem", "partition", "account", "qos", "constraint", "job_name", "signal", "python",
             "log_dir"}


def check_defaults(conf: dict[str, Any], where: str = "[tool.slurmresume]") -> dict[str, Any]:
    """Types of the configuration file's values, checked before anything uses them: one line
    naming the key, the value and what it must be (never a TypeError later)."""
    for key, value in conf.items():
        name = key.replace("_", "-")
        if key in _INT_KEYS and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{name} = {value!r} in {where} must be a whole number, e.g. {name} = 2")
        if key in _STR_KEYS and not isinstance(value, str):
            raise ConfigError(f"{name} = {value!r} in {where} must be a quoted string, e.g. {name} = \"...\"")
        if key == "snapshot_every" and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise ConfigError(f"snapshot-every = {value!r} in {where} must be \"auto\", \"off\" or a number of steps")
        if key == "hang_timeout" and (isinstance(value, bool) or not isinstance(value, (int, float, str))):
            raise ConfigError(f"hang-timeout = {value!r} in {where} must be \"auto\", \"off\" or seconds")
        if key == "time" and (isinstance(value, bool) or not isinstance(value, (int, str))):
            raise ConfigError(f"time = {value!r} in {where} must be minutes or \"HH:MM:SS\"")
    return conf


def load_defaults(start: Path) -> dict[str, Any]:
    """Defaults for `submit`: `[tool.slurmresume]` of the nearest pyproject.toml, or the top
    level of the nearest slurmresume.toml, searching from `start` upwards."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    for d in [start, *start.parents]:
        for name in ("slurmresume.toml", "pyproject.toml"):
            p = d / name
            if p.is_file():
                try:
                    data = tomllib.loads(p.read_text())
                except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                    raise ConfigError(f"{p} is not valid TOML: {exc}") from None
                table = data if name == "slurmresume.toml" else data.get("tool", {}).get("slurmresume")
                if table is not None:
                    if not isinstance(table, dict):
                        raise ConfigError(f"[tool.slurmresume] in {p} must be a table")
                    where = f"{p}" if name == "slurmresume.toml" else f"[tool.slurmresume] of {p}"
                    return check_defaults({k.replace("-", "_"): v for k, v in table.items()}, where)
    return {}

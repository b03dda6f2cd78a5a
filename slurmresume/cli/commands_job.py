"""Job commands: `submit` (to Slurm, or `--local`) and `drill`. Thin adapters over the library: the
options become a JobSpec here; `submit`'s workflow is job.submitflow, `drill`'s tools.drill."""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ..errors import ConfigError
from ..job.config import JobSpec, load_defaults, parse_sbatch_extras, split_signal
from ..job.hang import HangBudgets
from .app import app, handle_errors
from .job_inputs import SpecOptions, find_python, next_command, refuse_local_ignored
from .options import JsonOut, ckpt_dir_option

if TYPE_CHECKING:
    from ..job.submitflow import SubmitFlags

# The defaults a JobSpec gets when neither the command line nor [tool.slurmresume] sets them (the
# options are None, so that a configured value is not overridden). No default for --time (the
# partition's DefaultTime applies) nor --max-requeues (no cap while runs progress).
_DEFAULTS = {"nodes": 1, "signal": "USR1", "signal_lead": 120, "hang_timeout": "auto",
             "max_hangs": 3, "snapshot_every": "auto"}
_HB = HangBudgets()  # the numbers --help shows are the ones the hang watch uses
_HANG_TIMEOUT_HELP = ("Hang watch, step budget: a rank silent longer than its phase's budget gets every rank's stacks "
                      "dumped, then the run is killed and restarted in the allocation. auto: "
                      f"{_HB.multiple:g}x the longest step + {_HB.floor_s:g} s after {_HB.warmup_steps} warm-up steps "
                      "(which get --hang-startup). SECONDS: that step budget instead. off: no watch.")
_HANG_STARTUP_HELP = ("Hang watch: seconds a rank may take from creating its Checkpointer through its first "
                      f"{_HB.warmup_steps} steps (data, compilation); a restore gets at least this.")
_HANG_BUSY_HELP = ("Hang watch: seconds a `with ckpt.busy():` stretch (an evaluation) may take; never less than the "
                   "step budget; ckpt.busy(budget_s=) overrides it.")
_HANG_SAVE_HELP = (f"Hang watch: a save or restore may take this many seconds + the larger of {_HB.save_multiple:g}x "
                   f"the longest save seen (this run or the log's) and {_HB.io_factor:g}x the time its bytes take "
                   f"(the rate: --hang-io-rate); a restore gets at least the start-up budget.")
_HANG_IO_RATE_HELP = ("Hang watch: the throughput (MB/s) assumed for a save, restore or mirror pull until the rank has "
                      "measured one of 64 MiB or more; lower it on a slow file system or bucket link.")
_SNAPSHOT_EVERY_HELP = ("Memory tier: every N steps each rank also snapshots its state into the node's memory (tmpfs, "
                        "the checkpoint format, at most two snapshots, refused with one warning when memory is short); "
                        "a restart inside the allocation restores from it first, verified, else from --ckpt-dir. auto: "
                        "as often as keeps its measured cost under 2% of the step time. off (or 0): none. One node only "
                        "for now.")

Opt = typer.Option


def _spec(script: Path, script_args: list[str] | None, opts: SpecOptions) -> JobSpec:
    """CLI values win over [tool.slurmresume] / slurmresume.toml defaults, which win over ours."""
    conf = load_defaults(Path.cwd())
    unknown = set(conf) - set(JobSpec.__dataclass_fields__) - {"sbatch", "gres"}
    if unknown:
        raise ConfigError(f"unknown key(s) {sorted(unknown)} in [tool.slurmresume]: see `slurmresume submit --help`")
    merged: dict[str, Any] = {**_DEFAULTS, **conf, **opts.given()}
    if merged.get("ckpt_dir") is None:
        raise ConfigError("no checkpoint directory: pass --ckpt-dir DIR or set ckpt-dir in [tool.slurmresume]")
    sbatch = opts.sbatch or conf.get("sbatch") or []
    if isinstance(sbatch, dict):
        sbatch = [f"{k}={v}" for k, v in sbatch.items()]
    gres = merged.pop("gres", None)
    merged["sbatch"] = parse_sbatch_extras([str(x) for x in sbatch] + ([f"gres={gres}"] if gres else []))
    setup = merged.get("setup") or ()
    merged["setup"] = (setup,) if isinstance(setup, str) else tuple(str(x) for x in setup)
    merged["signal"], lead = split_signal(str(merged["signal"]), opts.signal_lead)
    if lead is not None:
        merged["signal_lead"] = lead
    from ..mirror.hook import refuse_bucket_root

    refuse_bucket_root(merged["ckpt_dir"], "--mirror")
    merged["ckpt_dir"] = Path(merged["ckpt_dir"]).expanduser().absolute()
    if merged.get("log_dir"):
        merged["log_dir"] = Path(merged["log_dir"]).expanduser().absolute()
    if merged.get("time") is not None:
        merged["time"] = str(merged["time"])
    if merged.get("python"):
        merged["python"] = find_python(str(merged["python"]))
    return JobSpec(script=script.expanduser().absolute(), script_args=tuple(script_args or ()), **merged)


def _preflight(spec: JobSpec, **kwargs: Any) -> None:
    """Refuse before anything is queued or written what could only fail on the node (tools/preflight.py)."""
    from ..tools.preflight import preflight

    for line in preflight(spec, **kwargs):
        _warn(line)


def _warn(line: str) -> None:
    typer.echo(f"warning: {line}", err=True)


ScriptArg = Annotated[Path, typer.Argument(metavar="TRAIN_SCRIPT", help="Training script run by torchrun on every node.",
                                           show_default=False)]
ArgsArg = Annotated[list[str] | None, typer.Argument(metavar="ARGS", help="Arguments for the script (put them "
                                                     "after --).", show_default="none")]


# `submit --help`: the options a first job needs stay in "Options", first; the rest by topic.
SUBMIT_PANELS = {
    "Slurm": ("cpus_per_task", "mem", "qos", "constraint", "job_name", "gres", "setup", "sbatch", "python",
              "rdzv_port"),
    "Preemption and failures": ("signal_lead", "max_requeues", "max_failures", "snapshot_every"),
    "Hang watch": ("hang_timeout", "hang_startup", "hang_busy", "hang_save", "hang_io_rate", "max_hangs"),
    "Resume, ownership, mirror": ("resume_from", "branch", "discard_newer", "takeover", "mirror", "shared_root",
                                  "no_script_check"),
}


@app.command(panels=SUBMIT_PANELS)
@handle_errors
def submit(
    script: ScriptArg,
    script_args: ArgsArg = None,
    ckpt_dir: Annotated[Path | None, ckpt_dir_option(
        help="Checkpoint root, a directory every rank can write (an s3:// bucket goes in --mirror); exported to the script as SLURMRESUME_CKPT_DIR.",
        default="ckpt-dir from slurmresume.toml or pyproject.toml; required", envvar=None)] = None,
    nodes: Annotated[int | None, Opt("--nodes", "-N", help="Number of nodes (one launcher + torchrun per node).", show_default=str(_DEFAULTS["nodes"]))] = None,
    nproc_per_node: Annotated[int | None, Opt(help="Processes (ranks) per node.", show_default="--gpus-per-node, else the N of --gres gpu[:type]:N, else 1")] = None,
    gpus_per_node: Annotated[int | None, Opt(help="GPUs per node to request.", show_default="none")] = None,
    cpus_per_task: Annotated[int | None, Opt(help="CPUs for each node's task.", show_default="the partition's")] = None,
    mem: Annotated[str | None, Opt(help="Memory per node, e.g. 64G.", show_default="the partition's")] = None,
    time: Annotated[str | None, Opt("--time", "-t", help="Time limit: MINUTES, HH:MM:SS or D-HH:MM:SS; longer than --signal-lead.", show_default="the partition's DefaultTime")] = None,
    partition: Annotated[str | None, Opt("--partition", "-p", help="Slurm partition.", show_default="the cluster's default partition")] = None,
    account: Annotated[str | None, Opt("--account", "-A", help="Slurm account.", show_default="your default account")] = None,
    qos: Annotated[str | None, Opt("--qos", "-q", help="Slurm QOS.", show_default="the account's default")] = None,
    constraint: Annotated[str | None, Opt("--constraint", "-C", help="Node feature constraint.", show_default="none")] = None,
    job_name: Annotated[str | None, Opt("--job-name", "-J", help="Job name.", show_default="slurmresume-<script>")] = None,
    signal: Annotated[str | None, Opt(metavar="[B:]SIG[@SECONDS]", help="Warning signal, as sbatch spells it: USR1@300 also sets --signal-lead; B:USR1 sends it to the batch shell only.", show_default=str(_DEFAULTS["signal"]))] = None,
    signal_lead: Annotated[int | None, Opt(help="Seconds before the time limit that the warning comes.", show_default=str(_DEFAULTS["signal_lead"]))] = None,
    max_requeues: Annotated[int | None, Opt(help="Cap on requeues (warnings and time limits alike).", show_default="no cap while each run commits a newer step; two runs in a row without one stop the job")] = None,
    max_failures: Annotated[int | None, Opt(help="Retry a crash (no signal) at most this many times from the newest checkpoint; 0: never retry.", show_default="no cap: carry on while each run commits a new step; two failed runs in a row without one stop the job")] = None,
    hang_timeout: Annotated[str | None, Opt(metavar="auto|SECONDS|off", help=_HANG_TIMEOUT_HELP,
                                             show_default=str(_DEFAULTS["hang_timeout"]))] = None,
    hang_startup: Annotated[float | None, Opt(metavar="SECONDS", help=_HANG_STARTUP_HELP,
                                              show_default=f"{_HB.startup_s:g}")] = None,
    hang_busy: Annotated[float | None, Opt(metavar="SECONDS", help=_HANG_BUSY_HELP, show_default=f"{_HB.busy_s:g}")] = None,
    hang_save: Annotated[float | None, Opt(metavar="SECONDS", help=_HANG_SAVE_HELP,
                                           show_default=f"{_HB.save_floor_s:g}")] = None,
    hang_io_rate: Annotated[float | None, Opt(metavar="MB/S", help=_HANG_IO_RATE_HELP,
                                             show_default=f"{_HB.io_rate_mbs:g}")] = None,
    max_hangs: Annotated[int | None, Opt(help="In-allocation restarts after a hang; the same hang twice in a row without a new checkpoint stops (and under Slurm holds) the job.", show_default=str(_DEFAULTS["max_hangs"]))] = None,
    snapshot_every: Annotated[str | None, Opt(metavar="auto|N|off", help=_SNAPSHOT_EVERY_HELP,
                                              show_default=str(_DEFAULTS["snapshot_every"]))] = None,
    gres: Annotated[str | None, Opt(help="Generic resources per node, as sbatch's --gres, e.g. gpu:a100:4; its GPUs also set the ranks per node when --nproc-per-node and --gpus-per-node are not given.", show_default="none")] = None,
    setup: Annotated[list[str] | None, Opt(metavar="LINE", help="A shell line the batch script runs before the launcher (repeatable, in order), e.g. --setup 'module load cuda/12.4' --setup 'source ~/venv/bin/activate'.", show_default="none")] = None,
    sbatch: Annotated[list[str] | None, Opt(help="Extra sbatch option KEY=VALUE (repeatable), e.g. --sbatch exclusive; arrays and heterogeneous jobs are refused.", show_default="none")] = None,
    rdzv_port: Annotated[int | None, Opt(help="Rendezvous port.", show_default="derived from the job id")] = None,
    python: Annotated[str | None, Opt(help="Python interpreter on the nodes.", show_default="this one")] = None,
    resume_from: Annotated[str | None, Opt(help="Start from this committed STEP (or step directory) instead of the newest.", show_default="the newest")] = None,
    branch: Annotated[Path | None, Opt(help="With --resume-from: continue in this NEW checkpoint root; the old one is untouched.", show_default="none")] = None,
    discard_newer: Annotated[bool, Opt("--discard-newer", help="With --resume-from: delete the steps newer than it.")] = False,
    takeover: Annotated[bool, Opt("--takeover", help="Take the checkpoint root over on weak evidence that its previous run is gone (only a heartbeat over 10 min old: another host or cluster, Slurm not answering). Strong proof (its job ended on its cluster, its pid dead on this host) needs no flag; a live owner is never taken over.")] = False,
    mirror: Annotated[str | None, Opt(metavar="s3://BUCKET/PREFIX", help="Also copy every committed step there "
                                      "(background upload; restore pulls newer steps from it). Endpoint and credentials "
                                      "from the AWS environment. Timeouts and retries: $SLURMRESUME_MIRROR_CONNECT_TIMEOUT "
                                      "(default 10 s), _READ_TIMEOUT (30 s), _ATTEMPTS per request and part (4), "
                                      "_CLOSE_DEADLINE for the last upload (240 s; then exit 78), _PULL_DEADLINE for a "
                                      "pull in restore (240 s); _UPLOAD_MIB, the memory of an upload's parts in flight (128 MiB: "
                                      "10 parts of 8 MiB).", show_default="none")] = None,
    no_script_check: Annotated[bool, Opt("--no-script-check", help="Submit even when the script never calls restore() or ckpt.step() itself (a module it imports does), or when its own imports fail with --python here (the nodes provide them). Without it such a script is refused.")] = False,
    shared_root: Annotated[bool, Opt("--shared-root", help="With --nodes > 1: every node mounts --ckpt-dir although it is on a local or memory file system. Without it such a root is refused, except under --dry-run.")] = False,
    local: Annotated[bool, Opt("--local", help="Run here without Slurm; a warning signal to this process saves and restarts.")] = False,
    dry_run: Annotated[bool, Opt("--dry-run", help="Print the sbatch script and torchrun command (with --local: the torchrun command); run, submit and write nothing.")] = False,
    json_out: JsonOut = False,
) -> None:
    """Submit TRAIN_SCRIPT to Slurm so that preemptions and time limits cost no work.

    Each node runs torchrun under a launcher that relays the warning signal (--signal, sent
    --signal-lead seconds before the end) to every rank; the ranks agree on one step, save it,
    commit, and the job requeues itself and resumes from the newest complete checkpoint.

    Example: slurmresume submit train.py --nodes 2 --gpus-per-node 8 --time 4:00:00 --ckpt-dir /ckpt/run1 -- --lr 3e-4
    """
    opts = SpecOptions(
        ckpt_dir=ckpt_dir, nodes=nodes, nproc_per_node=nproc_per_node, gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task, mem=mem, time=time, partition=partition, account=account, qos=qos,
        constraint=constraint, job_name=job_name, signal=signal, signal_lead=signal_lead, max_requeues=max_requeues,
        max_failures=max_failures, hang_timeout=hang_timeout, hang_startup=hang_startup, hang_busy=hang_busy,
        hang_save=hang_save, hang_io_rate=hang_io_rate, max_hangs=max_hangs, gres=gres, setup=setup, sbatch=sbatch,
        rdzv_port=rdzv_port, python=python, mirror=mirror, snapshot_every=snapshot_every)
    from ..job.submitflow import SubmitFlags

    _submit(script, script_args, opts, SubmitFlags(
        local=local, dry_run=dry_run, json_out=json_out, resume_from=resume_from, branch=branch,
        discard_newer=discard_newer, takeover=takeover, no_script_check=no_script_check, shared_root=shared_root))


def _submit(script: Path, script_args: list[str] | None, opts: SpecOptions, flags: SubmitFlags) -> None:
    """Build the JobSpec, run `submit`'s workflow (job.submitflow) and print its result."""
    from ..job.submitflow import run_submit
    from ..tools.preflight import submit_checks
    from .render_job import print_submit_result

    spec = _spec(script, script_args, opts)
    if flags.local:
        refuse_local_ignored(spec, opts)
    print_submit_result(run_submit(spec, flags, submit_checks(), warn=_warn), json_out=flags.json_out)


@app.command()
@handle_errors
def drill(
    script: ScriptArg,
    script_args: ArgsArg = None,
    preemptions: Annotated[int | None, Opt(help="Warnings to inject at random steps.", show_default="3, or 0 with --hang", min=1)] = None,
    hang: Annotated[int, Opt("--hang", help="Hangs to inject instead: a seeded rank stops making progress at a seeded step; each must be detected, dumped for every rank and restarted in the allocation.", min=0)] = 0,
    hang_timeout: Annotated[str, Opt(metavar="auto|SECONDS|off", help="As for submit; auto in a hang drill uses a 5 s floor instead of 600 s and a 120 s start-up budget (the script is short and its steps are measured).")] = "auto",
    nproc_per_node: Annotated[int, Opt(help="Processes (gloo on CPU, NCCL on GPU).", min=1)] = 1,
    seed: Annotated[int, Opt(help="Seed for choosing the preemption steps.")] = 0,
    workdir: Annotated[Path, Opt(help="Where both runs keep their checkpoints, each in a root of its own under it (uninterrupted/, preempted/; so it is no -d/--ckpt-dir): a new or empty directory, or one an earlier drill created (only its run folders are replaced).")] = Path("runs/drill"),
    ignore: Annotated[list[str] | None, Opt(help="What may differ (repeatable): a state key or a metrics= key (fnmatch pattern for metrics, e.g. '*_runtime'), one RNG stream (rng.python, rng.numpy, rng.torch_cpu, rng.torch_cuda) or all of them (rng).", show_default="none")] = None,
    json_out: JsonOut = False,
    mirror: Annotated[str | None, Opt(metavar="s3://BUCKET/PREFIX", help="Also exercise the mirror: both runs copy their steps to a new scratch prefix BUCKET/slurmresume-drill/<id>/ (never PREFIX itself, which is left as it is), and the preempted run's last step must be there, verified.", show_default="no mirror")] = None,
) -> None:
    """Prove that TRAIN_SCRIPT resumes exactly, here, before spending cluster hours.

    Runs it once uninterrupted and once with --preemptions warning signals at seeded random
    steps (through the real launcher and torchrun), then compares the final checkpoints tensor
    by tensor. Exit 0 when bitwise equal, every restart restored the step the run before it
    committed and went on from the next one, and the metrics= both runs passed agree bitwise at
    every step; exit 1 naming what differs, causes first (RNG streams, plain values and user
    objects, then the optimizer and model they feed). An RNG stream that differed between the
    runs already at their first step is reported as never seeded, not failed. Hermetic: both
    runs live under --workdir; no configured mirror is used (--mirror: a scratch prefix). Ctrl-C: exit 130, no verdict.

    With --hang N it injects N hangs instead, and passes only when each was detected, every rank's
    stacks were dumped, the run restarted inside the allocation, and the final checkpoint is
    bitwise equal to the uninterrupted run's.

    Example: slurmresume drill examples/train.py --preemptions 3 --nproc-per-node 2 -- --steps 60
    Example: slurmresume drill examples/train.py --hang 2 --nproc-per-node 2 -- --steps 40
    """
    from ..job.submitflow import stdout_to_stderr
    from ..tools.compare import culprits
    from ..tools.drill import DrillInterrupted, run_drill, scratch_mirror
    from .render_job import print_drill, print_json

    if hang and preemptions:
        raise ConfigError("--hang and --preemptions cannot be combined in one drill: run one drill of each")
    workdir = workdir.expanduser().absolute()
    spec = _spec(script, script_args, SpecOptions(ckpt_dir=workdir, nproc_per_node=nproc_per_node,
                                                  hang_timeout=hang_timeout))
    _preflight(spec, strict_script=False)
    scratch = scratch_mirror(mirror, uuid.uuid4().hex[:12]) if mirror else None  # ConfigError on a bad URL
    # --json: stdout carries the verdict alone (`| jq` works); the runs' output goes to stderr
    try:
        with stdout_to_stderr() if json_out else contextlib.nullcontext():
            report = run_drill(spec, preemptions=0 if hang else (preemptions or 3), seed=seed, workdir=workdir,
                               ignore_keys=tuple(ignore or ()), hangs=hang, mirror=scratch)
    except (DrillInterrupted, KeyboardInterrupt):
        typer.echo(f"drill interrupted (Ctrl-C): no verdict; what ran so far is under {workdir}", err=True)
        raise typer.Exit(130) from None
    if json_out:
        print_json({"ok": report.ok, "steps": report.steps, "planned": report.planned,
                    "preemptions": report.preemptions, "missed": report.missed, "saved_steps": report.saved_steps,
                    "mirror": report.mirror,
                    "hangs": report.hang_json(), "resume_problems": report.resume_problems,
                    "metric_difference": report.metric_difference and vars(report.metric_difference),
                    "notes": report.notes,
                    "differences": [{"rank": d.rank, "key": d.key, "detail": d.detail, "hint": d.hint,
                                     "cause": d.cause, "culprit": d in culprits(report.differences)}
                                    for d in report.differences]})
    else:
        print_drill(report, next_command=next_command(spec))
    if not report.ok:
        raise typer.Exit(1)

"""Checkpoint commands (status, prune, verify, latest), registered on the app when cli/__init__.py imports it.

Each is a thin adapter: options -> the root, opened once (`options.open_ckpt_root`: a directory
or a bucket, storage.py) -> its calls (`Root.latest`/`verify`/`records`/`plan`/`prune`;
tools/status.py on a directory) -> render (render.py) or JSON. Errors are SlurmResumeError subclasses; `handle_errors` turns
them into one `error: ...` line on stderr and exit code 1.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from ..duration import parse_duration
from ..errors import (
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    UnreadableCheckpointError,
)
from ..storage import BucketRoot, Root, is_bucket, open_step_url
from .app import app, handle_errors
from .options import CkptDir, JsonOut, Mode, ModeOpt, open_ckpt_root, root_hint
from .shared import confirm_delete, emit_json, latest_json, prune_json, verify_json


def _refuse_misplaced(root: Path) -> None:
    """A drill's folder or a step folder is not a root: one line pointing at the right one."""
    from ..tools.rootkind import misplaced_root

    line = misplaced_root(root)
    if line:
        raise ConfigError(line)


@app.command(context_settings={"allow_extra_args": True})
@handle_errors
def status(
    ctx: typer.Context,
    ckpt_dir: CkptDir = None,
    job: Annotated[str | None, typer.Option(
        "--job", "-j", metavar="ID", help="Slurm job id to show.", show_default="the newest job id in the event log")] = None,
    best: Annotated[str | None, typer.Option(
        "--best", metavar="METRIC", help="Mark the checkpoint with the best value of METRIC "
        "(a key of the metrics= you pass when saving, e.g. loss).", show_default="none")] = None,
    mode: ModeOpt = Mode.min,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Also recompute every complete checkpoint's checksums (reads every shard).")] = False,
    limit: Annotated[int, typer.Option(
        "--limit", help="Show at most this many checkpoint rows (newest first; 0: all).")] = 20,
    as_json: JsonOut = False,
    watch: Annotated[str | None, typer.Option(
        "--watch", metavar="SECONDS", help="Redraw every SECONDS (e.g. 10, 30s, 1m) until Ctrl-C.",
        show_default="print once")] = None,
    plot: Annotated[Path | None, typer.Option(
        "--plot", metavar="FILE", help="Also draw the run's timeline (step over time, saves, warnings, requeues, "
        "failures) into this picture: .png, .pdf, .svg, .jpg, .webp, .tif, .eps or .ps (no extension: FILE.png); needs matplotlib: pip install 'slurmresume[plot]'.", show_default="no picture")] = None,
    mirror_check: Annotated[bool, typer.Option(
        "--mirror-check/--no-mirror-check", help="Ask the run's mirror (the s3:// URL in the event log) for its "
        "newest committed step and uploads in flight; a bucket behind the newest local step is AT RISK. Bounded "
        "by SLURMRESUME_MIRROR_CONNECT_TIMEOUT/READ_TIMEOUT/ATTEMPTS. --no-mirror-check stays off the network.")] = True,
) -> None:
    """Is my run healthy? A three-line verdict, then every checkpoint, then the history.

    The headline says HEALTHY / AT RISK / STOPPED (or STARTING / FINISHED) and why; the last
    step, its age and speed; the newest complete checkpoint and the work a crash now would lose.
    Reads the checkpoint root, its event log and, when Slurm is installed here, squeue/sacct.
    Never changes anything.

    Exit codes: 0 healthy, starting or finished; 3 at risk (a corrupt checkpoint, a failed
    save, or no commit for 1.5 save intervals); 4 stopped (Slurm or the log says the run ended
    without finishing); 5 unknown (Slurm here knows no such job); 1 a usage error. --json carries the same verdict.

    Example: slurmresume status --ckpt-dir runs/exp1 --best loss
    """
    from ..tools.status import compute_status
    from . import render as _render

    if ctx.args:  # `status DIR`: collected, not an argument, so usage and --help do not show one
        raise ConfigError(root_hint("status", ctx.args[0]))
    if limit < 0:
        raise ConfigError(f"--limit must be >= 0 (0 shows all), got {limit}")
    store = open_ckpt_root(ckpt_dir, "status")
    if isinstance(store, BucketRoot):  # its steps only (no job, no event log in a bucket)
        from .commands_remote import bucket_status

        bucket_status(store, verify=verify, limit=limit, as_json=as_json)
        return
    root = store.directory
    assert root is not None  # a root that is not a bucket is a directory
    _refuse_misplaced(root)
    if job is not None and not re.fullmatch(r"\d+(_\d+)?", job):
        raise ConfigError(f"--job {job!r} is not a Slurm job id: use digits, e.g. --job 12345")
    interval = parse_duration(watch, "--watch") if watch is not None else None
    if interval is not None and interval <= 0:
        raise ConfigError(f"--watch {watch!r} must be more than 0 seconds")
    if interval is not None and as_json:
        raise ConfigError("--watch and --json cannot be combined: poll `status --json` instead")

    if plot is not None:  # a name it cannot write is refused before anything is read
        from ..tools.plot import plot_path

        plot_path(plot.expanduser().absolute())

    def compute() -> Any:
        return compute_status(root, job_id=job, best_metric=best, mode=mode.value, verify=verify,
                              with_interval=True, rows_limit=limit or None, mirror_check=mirror_check)

    if interval is not None:
        _render.watch(compute, interval, limit)
        return
    st = compute()
    if as_json:
        emit_json(st.to_json())
    else:
        _render.print_status(st, limit)
    if plot is not None:
        from ..tools.plot import plot_timeline

        written = plot_timeline(root, plot.expanduser().absolute(), now=st.now)
        typer.echo(f"timeline written to {written}", err=True)
    if st.verdict is not None and st.verdict.exit_code:
        raise typer.Exit(st.verdict.exit_code)


@app.command()
@handle_errors
def prune(
    keep: Annotated[int, typer.Option("--keep", metavar="N", help="Keep the N newest complete checkpoints "
                                      "(N >= 1). Incomplete directories never count.")],
    keep_every: Annotated[int | None, typer.Option(
        "--keep-every", metavar="M", help="Also keep every complete step divisible by M (e.g. 1000).",
        show_default="off")] = None,
    keep_best: Annotated[str | None, typer.Option(
        "--keep-best", metavar="METRIC", help="Also keep the complete checkpoint with the best METRIC.",
        show_default="off")] = None,
    mode: ModeOpt = Mode.min,
    remove_incomplete_older_than: Annotated[str | None, typer.Option(
        "--remove-incomplete-older-than", metavar="DURATION", help="Also remove incomplete or corrupt "
        "directories idle for DURATION (e.g. 12h, 2d).", show_default="leave them alone")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only print the plan; delete nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
    ckpt_dir: CkptDir = None,
    as_json: JsonOut = False,
) -> None:
    """Delete old checkpoints, keeping the newest N (and, if asked, every M-th and the best).

    Never deletes the newest complete checkpoint, the best one under --keep-best, or a
    directory being written. Prints the plan first; asks before deleting unless --yes.
    Deletion is crash-safe: each directory disappears in one rename before its files go.
    Example: slurmresume prune --keep 3 --keep-best loss --dry-run
    """
    from .. import retention as rt
    from . import render as _render

    older = (parse_duration(remove_incomplete_older_than, "--remove-incomplete-older-than")
             if remove_incomplete_older_than is not None else None)
    policy = rt.RetentionPolicy(keep=keep, keep_every=keep_every, keep_best=keep_best, mode=mode.value,
                                remove_incomplete_older_than=older)
    root = open_ckpt_root(ckpt_dir, "prune")  # a bucket: the same plan, marker-first deletion
    records = root.records()
    plan = root.plan(records, policy, time.time())
    if plan.missing_metric:
        raise ConfigError(f"--keep-best {keep_best!r}: no complete checkpoint records that metric; "
                          f"metrics found: {', '.join(rt.metric_names(records)) or 'none'}")
    leftovers = root.leftovers()
    if not as_json:
        _render.print_plan(plan, leftovers, dry_run)
    result = None
    if not dry_run and (plan.delete or leftovers):
        confirm_delete(len(plan.delete) + len(leftovers), yes, as_json)
        with _render.progress("deleting") as bar:
            result = root.prune(policy, approved={r.name for r in plan.delete}, progress=bar)
        if not as_json:
            _render.print_result(result)
    elif not as_json and not dry_run:
        typer.echo("nothing to delete")
    if as_json:
        emit_json(prune_json(root.url, policy, plan, leftovers, dry_run, result))


@app.command()
@handle_errors
def verify(
    target: Annotated[str | None, typer.Argument(
        metavar="STEP|URL", help="Step to verify ('latest': the newest complete one), or a bucket root or step URL "
        "(s3://bucket/run, s3://bucket/run/step_000001200).", show_default="the newest complete checkpoint")] = None,
    every: Annotated[bool, typer.Option("--all", help="Verify every committed checkpoint.")] = False,
    ckpt_dir: CkptDir = None,
    as_json: JsonOut = False,
) -> None:
    """Recompute shard checksums and compare them with the manifest.

    Exits 1 and names each bad file when a checkpoint fails (restore would then fall back to
    the previous one). Reads every byte of the checked shards. --json prints every checked
    checkpoint and its problems; the exit code is the same.
    Example: slurmresume verify --all --ckpt-dir runs/exp1 (or: slurmresume verify s3://bucket/exp1)
    """
    from . import render as _render

    root: Root | None = None
    if target is not None and is_bucket(target):  # a bucket root or step URL
        if ckpt_dir is not None:
            raise ConfigError(f"give the bucket once: {target} as the argument or --ckpt-dir, not both")
        root, url_step = open_step_url(target)
        target = None if url_step is None else str(url_step)
    if target == "latest":  # as inspect and export spell the newest complete checkpoint
        target = None
    if target is not None and not re.fullmatch(r"-?\d+", target) and Path(target).expanduser().is_dir():
        raise ConfigError(root_hint("verify", target, "a step"))
    if target is not None and not re.fullmatch(r"-?\d+", target):
        raise ConfigError(f"{target!r} is not a step number, latest, or an s3:// URL")
    step = int(target) if target is not None else None
    if root is None:
        root = open_ckpt_root(ckpt_dir, "verify")
    if step is not None and step < 0:
        raise ConfigError(f"STEP must be >= 0, got {step}")
    if step is not None and every:
        raise ConfigError("give either a STEP or --all, not both")
    with _render.progress("verifying checkpoints") as bar:
        results = root.verify(step=step, every=every, progress=bar)
    if as_json:
        emit_json(verify_json(root.url, results))
    else:
        _render.print_verify(results)
    bad = [p for r in results if not r.ok and not r.unreadable for p in r.problems]
    if bad:
        failed = sum(not r.ok and not r.unreadable for r in results)
        raise CorruptCheckpointError(f"{failed} of {len(results)} checkpoint(s) failed verification: {'; '.join(bad)}")
    unread = [p for r in results if r.unreadable for p in r.problems]
    if unread:
        raise UnreadableCheckpointError(f"{len(unread)} of {len(results)} checkpoint(s) not verified: {'; '.join(unread)}")


@app.command()
@handle_errors
def latest(
    root_arg: Annotated[str | None, typer.Argument(
        metavar="ROOT|URL", help="The checkpoint root or bucket (s3://bucket/run), as -d/--ckpt-dir gives it "
        "(the older spelling, kept for scripts).", show_default="-d/--ckpt-dir's default")] = None,
    ckpt_dir: CkptDir = None,
    verify: Annotated[bool, typer.Option(
        "--verify", help="Also recompute the checksums of each step it considers, newest first, and skip one that "
        "fails (reads every byte of its shards; without it no shard byte is read).")] = False,
    as_json: JsonOut = False,
) -> None:
    """Print the path of the newest complete checkpoint (for scripts).

    Prints nothing on stdout and exits 1 when there is none (--json: its object with "path":
    null, and exit 1). Newer directories without a commit marker, or whose manifest or file
    sizes are wrong, are skipped; without --verify it does not read the shards, so a flipped bit
    inside one is not seen (restore and export check every byte they read; `verify` finds it):
    pass --verify to skip such a step too. A newer step this version cannot read (written by a
    newer slurmresume) is not skipped: it exits 1 naming it. The root may also be given as an
    argument (`slurmresume latest DIR`, as older scripts do); -d/--ckpt-dir is the spelling of
    every command.
    Example: cp -r "$(slurmresume latest --verify -d runs/exp1)" /archive/
    """
    if root_arg is not None and ckpt_dir is not None:
        raise ConfigError(f"give the root once: {root_arg} as the argument or --ckpt-dir, not both")
    root = open_ckpt_root(root_arg if root_arg is not None else ckpt_dir, "latest")
    if root.directory is None and verify:  # not silently ignored: the bucket's steps are checked by `verify URL`
        raise ConfigError(f"--verify reads a local root's shards; for a bucket run: slurmresume verify {root.url}")
    skipped: list[Any] = []

    def say_skipped(info: Any) -> None:
        """`latest --verify`: each newer step it passed over, and why, on stderr (stdout stays the path)."""
        skipped.append(info)
        typer.echo(f"skipped {info.url}: {info.problem}", err=True)

    info = root.latest(verify=verify, scan=True, skipped=say_skipped if verify else None)
    if as_json:
        emit_json(latest_json(root.url, info.step if info else None, info.url if info else None,
                              [(i.url, i.problem) for i in skipped]))
    if info is None:
        raise NoCheckpointError(f"no complete checkpoint under {root.url}")
    if not as_json:
        typer.echo(info.url)

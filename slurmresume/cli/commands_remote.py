"""`latest`, `verify`, `prune` and `status` on an `s3://` root: what commands_ckpt.py calls when
--ckpt-dir is a bucket URL. Same output, same JSON, same exit codes as on a local root. (Command
line code, so it lives in cli/ and mirror/ stays below it; what both share is in shared.py.)"""

from __future__ import annotations

import time
from typing import Any

import typer

from ..errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from ..mirror import remote
from ..mirror.s3 import client, parse_s3_url
from . import render as _render
from .shared import confirm_delete, emit_json, latest_json, prune_json, verify_json


def latest(url: object, *, as_json: bool = False) -> None:
    loc = parse_s3_url(str(url))
    info = remote.find_latest(client(), loc)
    if as_json:
        emit_json(latest_json(loc.url, info.step if info else None, info.url if info else None, []))
    if info is None:
        raise NoCheckpointError(f"no complete checkpoint under {loc.url}")
    if not as_json:
        typer.echo(info.url)


def verify(url: object, step: int | None, every: bool, *, as_json: bool = False) -> None:
    """Hash every shard object of the chosen step(s) against its manifest."""
    from ..tools.status import VerifyResult

    loc, s3 = parse_s3_url(str(url)), client()
    if step is not None and step < 0:
        raise ConfigError(f"STEP must be >= 0, got {step}")
    if step is not None and every:
        raise ConfigError("give either a STEP or --all, not both")
    steps = remote.scan(s3, loc)
    if every:
        chosen = [rs for rs in steps if rs.has_marker]
    elif step is not None:
        chosen = [rs for rs in steps if rs.step == step]
        if not chosen:
            raise NoCheckpointError(f"no step {step} under {loc.url}")
        if not chosen[0].has_marker:
            raise NoCheckpointError(f"step {step} under {loc.url} is incomplete (no commit marker): nothing to verify")
    else:
        newest = remote.find_latest(s3, loc, steps=steps)
        chosen = [rs for rs in steps if newest is not None and rs.step == newest.step]
    if not chosen:
        raise NoCheckpointError(f"no complete checkpoint under {loc.url} to verify")
    results = []
    for rs in chosen:
        info = remote.inspect(s3, loc, rs, verify=True)
        results.append(VerifyResult(rs.step, info.url, info.complete, [info.problem] if info.problem else []))
    if as_json:
        emit_json(verify_json(loc.url, results))
    else:
        _render.print_verify(results)
    bad = [p for r in results if not r.ok for p in r.problems]
    if bad:
        failed = sum(not r.ok for r in results)
        raise CorruptCheckpointError(f"{failed} of {len(results)} checkpoint(s) failed verification: {'; '.join(bad)}")


def prune(url: object, policy: Any, *, dry_run: bool, yes: bool, as_json: bool) -> None:
    """The plan first; then marker-first deletion of what a re-made plan still deletes."""
    from .. import retention as rt

    loc, s3 = parse_s3_url(str(url)), client()
    records = remote.records(s3, loc)
    plan = rt.plan_prune(records, policy, time.time())
    if plan.missing_metric:
        raise ConfigError(f"--keep-best {policy.keep_best!r}: no complete checkpoint records that metric; "
                          f"metrics found: {', '.join(rt.metric_names(records)) or 'none'}")
    if not as_json:
        _render.print_plan(plan, [], dry_run)
    result = None
    if not dry_run and plan.delete:
        confirm_delete(len(plan.delete), yes, as_json)
        result = remote.prune(s3, loc, policy, approved={r.name for r in plan.delete})
        if not as_json:
            _render.print_result(result)  # type: ignore[arg-type]  # same fields as PruneResult
    elif not as_json and not dry_run:
        typer.echo("nothing to delete")
    if as_json:
        emit_json(prune_json(loc.url, policy, plan, [], dry_run, result))  # type: ignore[arg-type]


def status(url: object, *, verify: bool, limit: int, as_json: bool) -> None:
    """The bucket's step folders, newest first: complete or why not, size, being uploaded.
    (No Slurm job or event log: those live with the run, not in the bucket.)"""
    import json

    from ..mirror.leftovers import ABANDONED_AFTER_S

    loc, s3 = parse_s3_url(str(url)), client()
    steps = remote.scan(s3, loc)
    infos = [remote.inspect(s3, loc, rs, verify) for rs in (steps[:limit] if limit else steps)]
    newest = remote.find_latest(s3, loc, steps=steps)
    now = time.time()
    abandoned = {rs.step for rs in steps if rs.uploading and now - rs.upload_started > ABANDONED_AFTER_S}
    rows: list[dict[str, Any]] = [{"step": i.step, "url": i.url, "complete": i.complete, "problem": i.problem,
             "bytes": i.manifest.total_bytes if i.manifest else None, "verified": i.verified,
             "uploading": i.uploading, "abandoned": i.step in abandoned,
             "created": i.manifest.created if i.manifest else None} for i in infos]
    in_flight = sum(rs.uploading and rs.step not in abandoned for rs in steps)
    if as_json:
        typer.echo(json.dumps({"schema": "slurmresume.mirror-status/1", "root": loc.url, "steps": len(steps),
                               "newest_complete": newest.step if newest else None, "uploads_in_flight": in_flight,
                               "abandoned_uploads": len(abandoned), "checkpoints": rows}, indent=2))
        return
    typer.echo(f"mirror {loc.url}: {len(steps)} step folder(s), newest complete: "
               f"{newest.step if newest else 'none'}, uploads in flight: {in_flight}"
               + (f", abandoned: {len(abandoned)}" if abandoned else ""))
    for r in rows:
        uploading = ("upload ABANDONED (over 6 h old: removed after the next upload)" if r["abandoned"]
                     else "being uploaded")
        state = "complete" + (" (verified)" if r["verified"] else "") if r["complete"] else \
            (uploading if r["uploading"] else f"INCOMPLETE: {r['problem']}")
        size = f"{r['bytes'] / 1e6:.1f} MB" if r["bytes"] is not None else "-"
        typer.echo(f"  {r['step']:>10}  {size:>10}  {state}")
    if limit and len(steps) > limit:
        typer.echo(f"  ... {len(steps) - limit} older step folder(s) not shown (--limit 0 shows all)")

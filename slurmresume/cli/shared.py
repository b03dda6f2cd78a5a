"""What the commands share, on any storage root (a directory or a bucket: storage.py): the
JSON printer, the delete prompt, the schemas of `prune --json`, `verify --json`, `latest --json`
and `export --json`. Below every commands_* module, so none imports another for them."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

import typer

from ..errors import ConfigError

PRUNE_SCHEMA = "slurmresume.prune/1"
VERIFY_SCHEMA = "slurmresume.verify/1"
LATEST_SCHEMA = "slurmresume.latest/1"
EXPORT_SCHEMA = "slurmresume.export/1"


def emit_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, allow_nan=False))


def _stdin_is_tty() -> bool:
    """A prompt needs someone to read it and to answer: `prune ... | tail` must not wait on one."""
    return sys.stdin.isatty() and sys.stdout.isatty()


def confirm_delete(count: int, yes: bool, as_json: bool) -> None:
    if yes:
        return
    if as_json or not _stdin_is_tty():
        raise ConfigError(f"refusing to delete {count} entr{'y' if count == 1 else 'ies'} without confirmation: "
                          "pass --yes to delete without asking (or --dry-run to only see the plan)")
    if not typer.confirm(f"Delete {count} entr{'y' if count == 1 else 'ies'} listed above?", default=False):
        typer.echo("aborted: nothing deleted", err=True)
        raise typer.Exit(1)


def prune_json(root: object, policy: Any, plan: Any, leftovers: list[str], dry_run: bool, result: Any) -> dict[str, Any]:
    """Schema "slurmresume.prune/1" (what `prune --json` prints):

    schema, root, dry_run   "slurmresume.prune/1", the root (str), bool
    policy                  the RetentionPolicy fields (durations in seconds)
    plan                    newest first: [{step, name, complete, action: "keep"|"delete", reasons}]
    newest_complete, best   steps (or null)
    leftovers               .deleting.* entries found (removed unless a dry run)
    deleted, cleaned        directory / leftover names removed (empty on a dry run)
    skipped                 [{name, reason}]: planned, but kept when re-checked under the lock
    """
    from dataclasses import asdict

    return {
        "schema": PRUNE_SCHEMA, "root": str(root), "dry_run": dry_run, "policy": asdict(policy),
        "plan": [{"step": d.record.step, "name": d.record.name, "complete": d.record.complete,
                  "action": "delete" if d.delete else "keep", "reasons": list(d.reasons)} for d in plan.decisions],
        "newest_complete": plan.newest.step if plan.newest else None,
        "best": plan.best.step if plan.best else None,
        "leftovers": leftovers,
        "deleted": result.deleted if result else [],
        "skipped": [{"name": n, "reason": why} for n, why in result.skipped] if result else [],
        "cleaned": result.cleaned if result else [],
    }


def verify_json(root: object, results: Sequence[Any]) -> dict[str, Any]:
    """Schema "slurmresume.verify/1" (what `verify --json` prints; the exit code is the same as
    without --json: 1 when a checkpoint fails or cannot be read):

    schema, root    "slurmresume.verify/1", the root or bucket URL (str)
    ok              every checkpoint checked passed
    checkpoints     newest first: [{step, path (a bucket: the step URL), ok,
                    unreadable (not checked: this version cannot read it), problems: [str]}]
    """
    return {"schema": VERIFY_SCHEMA, "root": str(root), "ok": all(r.ok for r in results),
            "checkpoints": [{"step": r.step, "path": str(r.path), "ok": r.ok, "unreadable": r.unreadable,
                             "problems": list(r.problems)} for r in results]}


def latest_json(root: object, step: int | None, path: object, skipped: Sequence[tuple[object, str]]) -> dict[str, Any]:
    """Schema "slurmresume.latest/1" (what `latest --json` prints; exit 1 when there is none):

    schema, root    "slurmresume.latest/1", the root or bucket URL (str)
    step, path      the newest complete checkpoint's step (int) and path (a bucket: its URL);
                    both null when there is none
    skipped         with --verify: the newer steps passed over, [{path, problem}], newest first
    """
    return {"schema": LATEST_SCHEMA, "root": str(root), "step": step, "path": None if path is None else str(path),
            "skipped": [{"path": str(p), "problem": why} for p, why in skipped]}


def export_json(summary: dict[str, Any]) -> dict[str, Any]:
    """Schema "slurmresume.export/1" (what `export --json` prints):

    schema          "slurmresume.export/1"
    step, out       the exported step (int), the file written (str)
    tensors, bytes  how many tensors it holds, its size in bytes
    """
    return {"schema": EXPORT_SCHEMA, "step": summary["step"], "out": summary["out"], "tensors": summary["tensors"],
            "bytes": summary["bytes"]}

"""What the checkpoint commands share, on a local root (commands_ckpt.py) and on a bucket
(commands_remote.py): the JSON printer, the delete prompt, `prune --json`'s schema. Below both,
so neither imports the other for them."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from ..errors import ConfigError

PRUNE_SCHEMA = "slurmresume.prune/1"


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


def prune_json(root: Path, policy: Any, plan: Any, leftovers: list[str], dry_run: bool, result: Any) -> dict[str, Any]:
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

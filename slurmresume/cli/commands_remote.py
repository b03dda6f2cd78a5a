"""`status` on an `s3://` root: what commands_ckpt.py calls when -d/--ckpt-dir is a bucket
(`latest`, `verify` and `prune` need nothing of their own there: they run the same code on any
storage root). A bucket holds no Slurm job and no event log, so its status is its step folders.
(Command line code, so it lives in cli/ and mirror/ stays below it.)"""

from __future__ import annotations

import time
from typing import Any

import typer

from ..storage import BucketRoot


def bucket_status(root: BucketRoot, *, verify: bool, limit: int, as_json: bool) -> None:
    """The bucket's step folders, newest first: complete or why not, size, being uploaded."""
    import json

    from ..mirror.leftovers import ABANDONED_AFTER_S

    steps = root.listing()
    infos = [root.inspect(rs.step, verify=verify, listed=rs) for rs in (steps[:limit] if limit else steps)]
    newest = root.latest(listing=steps)
    now = time.time()
    abandoned = {rs.step for rs in steps if rs.uploading and now - rs.upload_started > ABANDONED_AFTER_S}
    rows: list[dict[str, Any]] = [{"step": i.step, "url": i.url, "complete": i.complete, "problem": i.problem,
             "bytes": i.manifest.total_bytes if i.manifest else None, "verified": i.verified,
             "uploading": i.uploading, "abandoned": i.step in abandoned,
             "created": i.manifest.created if i.manifest else None} for i in infos]
    in_flight = sum(rs.uploading and rs.step not in abandoned for rs in steps)
    if as_json:
        typer.echo(json.dumps({"schema": "slurmresume.mirror-status/1", "root": root.url, "steps": len(steps),
                               "newest_complete": newest.step if newest else None, "uploads_in_flight": in_flight,
                               "abandoned_uploads": len(abandoned), "checkpoints": rows}, indent=2))
        return
    typer.echo(f"mirror {root.url}: {len(steps)} step folder(s), newest complete: "
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

"""The sections of a status snapshot, each read on its own: the checkpoint rows (from the step
directories), the hang watch's rank view, the write path, the cost of interruptions and the
mirror asked now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.store import UNREADABLE, check_checksums
from ..errors import ConfigError
from ..events import EV_MIRROR_BEHIND, EV_MIRROR_FAILED, EV_SAVE_COMMITTED
from ..retention import best_record, metric_names, metric_value, record_from_info
from ..storage import BucketRoot, CheckpointInfo, DirRoot
from .health import bucket_lag, mirror_url
from .status_model import CheckpointRow
from .timeline import cost_line, preemption_cost


def ask_mirror(events: list[dict[str, Any]], rows: list[CheckpointRow], now: float, problems: list[str],
               warnings: list[str]) -> dict[str, Any] | None:
    """The bucket's side of the lag: one listing (and the newest step's marker and manifest)
    with the mirror's own timeouts and tries. None when the log names no mirror. A bucket that
    cannot be asked is a warning (the log's own account of the mirror still counts)."""
    url = mirror_url(events)
    if url is None:
        return None
    newest = next((r for r in rows if r.newest), None)
    failed = [e for e in events if e.get("event") in (EV_MIRROR_FAILED, EV_MIRROR_BEHIND)]
    out: dict[str, Any] = {"url": url, "newest_local": newest.step if newest else None, "newest_in_bucket": None,
                           "uploads_in_flight": None, "last_error": failed[-1].get("error") if failed else None,
                           "behind": None, "error": None}
    try:
        from ..errors import CheckpointError, ConfigError
        from ..storage.s3 import parse_s3_url
        from ..storage.settings import MirrorSettings

        settings = MirrorSettings.from_env()
        bucket = BucketRoot(parse_s3_url(url), settings=settings)
        steps = bucket.listing()
        latest = bucket.latest(listing=steps)
    except (CheckpointError, ConfigError, OSError) as exc:
        out["error"] = str(exc)[:500]
        warnings.append(f"could not ask the mirror {url} how far behind it is: {out['error']}")
        return out
    out["newest_in_bucket"] = latest.step if latest else None
    out["uploads_in_flight"] = sum(rs.uploading for rs in steps)
    uploading = newest is not None and any(rs.uploading and rs.step == newest.step for rs in steps)
    lag = bucket_lag(url, out["newest_local"], newest.age_seconds if newest else None, out["newest_in_bucket"],
                     uploading, settings.close_deadline)
    out["behind"] = lag is not None
    if lag is not None and not any(url in p and "lacks" in p for p in problems):  # the log said it already
        (problems if lag[0] == "problem" else warnings).append(lag[1])
    return out


def rank_view(root: Path, now: float) -> dict[str, Any] | None:
    """The newest job's per-node summaries (`<root>/.runs/<job>.node-<n>.ranks.json`, written by
    each node's launcher every few seconds) merged, with ages recomputed at `now` and the
    stragglers named (hang.stragglers)."""
    import json

    from ..job.hang import STRAGGLER_MARGIN, stragglers

    groups: dict[str, list[dict[str, Any]]] = {}
    for path in (root / ".runs").glob("*.ranks.json"):
        try:
            data = json.loads(path.read_text()[:1 << 22])
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("ranks"), dict):
            groups.setdefault(path.name.rsplit(".node-", 1)[0], []).append(data)
    if not groups:
        return None
    key, nodes = max(groups.items(), key=lambda kv: max(float(d.get("time") or 0) for d in kv[1]))
    ranks: dict[str, Any] = {}
    for node in nodes:
        for rank, row in node["ranks"].items():
            if isinstance(row, dict):
                if isinstance(row.get("time"), (int, float)):
                    row["age_s"] = round(now - row["time"], 1)
                ranks[rank] = row
    medians = {int(r): float(v["median_s"]) for r, v in ranks.items() if isinstance(v.get("median_s"), (int, float))}
    samples = {int(r): int(v.get("samples") or 0) for r, v in ranks.items()}
    memory = {str(d.get("host")): d["memory"] for d in nodes if isinstance(d.get("memory"), dict)}
    return {"job_key": key, "time": max(float(d.get("time") or 0) for d in nodes), "memory": memory or None,
            "budgets": nodes[0].get("budgets"), "ranks": dict(sorted(ranks.items(), key=lambda kv: int(kv[0]))),
            "stragglers": stragglers(medians, samples), "straggler_margin": STRAGGLER_MARGIN}


def writer_summary(root: Path, events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The write path chosen for this root's file system (the calibration cache) and the one the
    newest save used (event log); None when neither is known."""
    from ..checkpoint.calibrate import cached_choice

    last = next((e for e in reversed(events) if e.get("event") == EV_SAVE_COMMITTED and e.get("writer")), None)
    cached = cached_choice(root)
    if last is None and cached is None:
        return None
    return {"last_save": last.get("writer") if last else None, "last_breakdown": last.get("breakdown") if last else None,
            **(cached or {})}


def cost_summary(events: list[dict[str, Any]], now: float) -> dict[str, Any] | None:
    """The measured down time and lost work of every interruption, their totals and share of the
    wall time, and the words the headline shows; None when no run was interrupted."""
    cost = preemption_cost(events, now)
    return None if cost is None else {**cost.to_json(), "summary": cost_line(cost)}



def _inspect_rows(root: Path, limit: int | None, scan: bool = True) -> tuple[list[CheckpointInfo], int]:
    """Newest first: all step directories, or the newest `limit` (continuing past them until a
    complete one is found), plus how many older ones were left out. `scan`: judged by markers."""
    store = DirRoot(root)
    if limit is None:
        return store.infos(scan=scan), 0
    steps = store.steps()
    infos: list[CheckpointInfo] = []
    for step in steps:
        if len(infos) >= limit and any(i.complete for i in infos):
            break
        infos.append(store.inspect(step, scan=scan))
    return infos, len(steps) - len(infos)


def checkpoint_rows(root: Path, best_metric: str | None, mode: str, verify: bool, now: float,
                     limit: int | None = None) -> tuple[list[CheckpointRow], dict[str, Any] | None, int]:
    infos, omitted = _inspect_rows(root, limit, scan=not verify)
    records = [record_from_info(i) for i in infos]
    rows = [_row(i, r, verify, now) for i, r in zip(infos, records, strict=True)]
    newest = next((row for row in rows if row.state == "complete"), None)
    if newest is not None:
        newest.newest = True
    if not best_metric:
        return rows, None, omitted
    best = best_record(records, best_metric, mode)
    if best is None:
        if any(r.complete for r in records):
            raise ConfigError(f"no complete checkpoint records metric {best_metric!r}; "
                              f"metrics found: {', '.join(metric_names(records)) or 'none'}")
        return rows, None, omitted
    for row in rows:
        row.best = row.name == best.name
    return rows, {"metric": best_metric, "mode": mode, "step": best.step,
                  "value": metric_value(best.metrics, best_metric)}, omitted


def _row(info: CheckpointInfo, rec: Any, verify: bool, now: float) -> CheckpointRow:
    state = ("complete" if info.complete else "unreadable" if info.unreadable else "corrupt" if info.has_marker
             else "unreadable" if (info.problem or "").startswith(UNREADABLE)
             else "being_written" if rec.in_progress else "incomplete")
    verified, problem = None, info.problem
    if verify and info.complete and info.manifest is not None:
        problems = check_checksums(info.path, info.manifest)
        verified, problem = not problems, "; ".join(problems) or None
    return CheckpointRow(info.step, info.path.name, str(info.path), state, info.created,
                         max(0.0, now - info.created), info.total_bytes,
                         info.world_size, verified,
                         rec.metrics, problem=problem)

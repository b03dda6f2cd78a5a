"""Which write path to use, learnt from real saves: the decisions of `calibrate`, as pure functions.

A one-time calibration goes stale: on 2026-12-04 the cache chose O_DIRECT (0.80 GB/s against
buffered 0.36 GB/s in a busy hour), and two hours later buffered writes ran at ~2 GB/s; nothing
re-measured, because only a save much *slower* than calibrated triggered a check (issue #32).
So the choice is a small bandit over the write paths (writer.STRATEGIES), per file system:

- The belief: for every path ever measured there (the calibration's probes measure all of them
  once), a running speed, an EWMA of the GB/s of real saves (ALPHA), with the wall time of its
  last measurement, how many real saves fed it, and whether it is still a probe's figure (the
  first real save replaces a probe's figure outright: probes are small and biased).
- The choice (`pick`) is the fastest belief measured within AGE_OUT_S. A belief older than that
  no longer competes (the disk may have changed since) but is explored first.
- Exploration: every EXPLORE_EVERY-th large, non-emergency save on the file system (a ticket
  counter kept with the belief, so that the rate holds whatever the number of ranks per node or
  the life of a process) uses the path measured longest ago instead of the best (with two paths
  that is the runner-up). Every path is kept, not only the near ones: the issue's buffered path
  was 0.45x of O_DIRECT at calibration and 2.5x of it later.
- An emergency save always takes the best and never explores (it is timed by a signal's lead).
- `update` folds one real save into the belief; the best is recomputed at once, so a path that
  is now far faster is adopted from its first explored save.

`belief_of` also reads the older cache entries (strategy + probe GB/s, with or without a trial).
The imperative shell (the cache file, its lock, the ticket) is in `calibrate`.
"""

from __future__ import annotations

import math
from typing import Any

ALPHA = 0.5  # weight of the newest save: the disk drifts 2x within the hour, saves are minutes apart
EXPLORE_EVERY = 8  # one large non-emergency save in this many explores
AGE_OUT_S = 3 * 86400.0  # an older measurement no longer competes for the choice
PROBE = "probe"
SAVE = "save"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def belief_of(entry: Any, strategies: tuple[str, ...]) -> dict[str, Any] | None:
    """The bandit state of a cache entry: {"paths": {name: {gbps, at, n, src}}, "tickets": int},
    or None when the entry holds nothing usable (missing, damaged, stale in the old sense).
    Entries written before the bandit (strategy + probe gbps + measured_at) become a belief of
    probes. Pure; never raises."""
    if not isinstance(entry, dict):
        return None
    paths: dict[str, dict[str, Any]] = {}
    raw = entry.get("paths")
    if isinstance(raw, dict):
        for name, p in raw.items():
            if name in strategies and isinstance(p, dict) and _number(p.get("gbps")) and _number(p.get("at")):
                n = p.get("n")
                paths[name] = {"gbps": float(p["gbps"]), "at": float(p["at"]),
                               "n": n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else 0,
                               "src": SAVE if p.get("src") == SAVE else PROBE}
    elif not entry.get("stale") and isinstance(entry.get("gbps"), dict) and _number(entry.get("measured_at") or 1):
        at = float(entry.get("measured_at") or 1)
        for name, g in entry["gbps"].items():
            if name in strategies and _number(g):
                paths[name] = {"gbps": float(g), "at": at, "n": 0, "src": PROBE}
        if entry.get("strategy") in strategies and entry["strategy"] not in paths:
            paths[entry["strategy"]] = {"gbps": 1e-3, "at": at, "n": 0, "src": PROBE}
    if not paths:
        return None
    tickets = entry.get("tickets")
    return {"paths": paths, "tickets": tickets if isinstance(tickets, int) and not isinstance(tickets, bool)
            and tickets >= 0 else 0}


def fresh(belief: dict[str, Any], now: float) -> dict[str, dict[str, Any]]:
    """The paths measured within AGE_OUT_S of `now` (a clock that stepped back counts as fresh)."""
    return {n: p for n, p in belief["paths"].items() if now - p["at"] <= AGE_OUT_S}


def best(belief: dict[str, Any], now: float) -> str | None:
    """The fastest fresh path; None when every measurement aged out (measure again)."""
    live = fresh(belief, now)
    return max(sorted(live), key=lambda n: live[n]["gbps"]) if live else None


def explores(ticket: int) -> bool:
    """Whether the save holding `ticket` (0, 1, 2, ... per file system) explores."""
    return ticket % EXPLORE_EVERY == EXPLORE_EVERY - 1


def pick(belief: dict[str, Any], now: float, *, emergency: bool, ticket: int | None) -> tuple[str | None, bool]:
    """(path, explored) for one save. `ticket`: this save's number on the file system, None for a
    save that may not explore (an emergency, a small shard). The best path, except on an exploring
    ticket: then the other path measured longest ago (ties: the faster first). Pure."""
    top = best(belief, now)
    if emergency or ticket is None or not explores(ticket) or top is None:
        return top, False
    others = [n for n in belief["paths"] if n != top]
    if not others:
        return top, False
    paths = belief["paths"]
    return min(sorted(others), key=lambda n: (paths[n]["at"], -paths[n]["gbps"])), True


def take_ticket(belief: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(this save's ticket, the belief with the counter moved on). Pure."""
    return belief["tickets"], {**belief, "tickets": belief["tickets"] + 1}


def update(belief: dict[str, Any], strategy: str, gbps: float, now: float) -> dict[str, Any]:
    """The belief after one real save of `gbps` with `strategy` (pure): an EWMA with weight ALPHA
    on the newest save; the first real save replaces a probe's figure; a path never seen joins."""
    if not _number(gbps):
        return belief
    old = belief["paths"].get(strategy)
    if old is None or old["src"] != SAVE:
        speed = gbps
    else:
        speed = ALPHA * gbps + (1 - ALPHA) * old["gbps"]
    n = (old or {}).get("n", 0) + 1
    paths = {**belief["paths"], strategy: {"gbps": round(speed, 4), "at": now, "n": n, "src": SAVE}}
    return {**belief, "paths": paths}


def to_entry(belief: dict[str, Any], now: float, **extra: Any) -> dict[str, Any]:
    """The cache entry for a belief: the belief itself plus `strategy` (its best, for older readers
    and for `status`) and `gbps` (the current speeds). Pure."""
    top = best(belief, now)
    return {**extra, "paths": belief["paths"], "tickets": belief["tickets"], "strategy": top,
            "gbps": {n: p["gbps"] for n, p in belief["paths"].items()}}


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def describe(belief: dict[str, Any], now: float) -> str:
    """One line for `status`: each path's speed, age and how many real saves fed it, fastest
    first, the best marked, and when the next exploration comes."""
    top = best(belief, now)
    paths = belief["paths"]
    parts = []
    for n in sorted(paths, key=lambda n: -paths[n]["gbps"]):
        p = paths[n]
        fed = f"{p['n']} save(s)" if p["src"] == SAVE else "probe"
        aged = ", aged out" if now - p["at"] > AGE_OUT_S else ""
        parts.append(f"{'*' if n == top else ''}{n} {p['gbps']:.2f} GB/s ({_age(now - p['at'])} ago, {fed}{aged})")
    wait = (EXPLORE_EVERY - 1 - belief["tickets"] % EXPLORE_EVERY) % EXPLORE_EVERY
    return "; ".join(parts) + f"; the large save {wait + 1} from now explores"

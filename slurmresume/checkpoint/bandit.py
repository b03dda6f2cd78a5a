"""Which write path to use, learnt from real saves: the decisions of `calibrate`, as pure functions.

A one-time calibration goes stale: on 2026-12-04 the cache chose O_DIRECT (0.80 GB/s against
buffered 0.36 GB/s in a busy hour), and two hours later buffered writes ran at ~2 GB/s; nothing
re-measured, because only a save much *slower* than calibrated triggered a check (issue #32).
So the choice is a small bandit over the write paths (writer.STRATEGIES), per file system:

- The belief: for every path ever measured there (the calibration's probes measure all of them
  once), a running speed, an EWMA of the GB/s of real saves (ALPHA), with the wall time of its
  last measurement, how many real saves fed it, whether it is still a probe's figure (the first
  real save replaces a probe's figure outright: probes are small and biased) and `t`, the ticket
  counter when it was last tried. Real saves with a forced path (SLURMRESUME_WRITER) feed it too.
- The choice (`best`) is the fastest belief measured within AGE_OUT_S. A belief older than that
  no longer competes (the disk may have changed since).
- Exploration, with a bounded cost. Every large, non-emergency save takes a ticket (a counter
  kept with the belief, so the rate holds whatever the number of ranks per node or the life of
  a process). A path other than the best is tried again once `spacing` large saves have passed
  since its last try: max(EXPLORE_EVERY, ceil(m * cost / EXPLORE_BUDGET)), where cost = best
  GB/s / its GB/s - 1 is the extra time one save on it is expected to take (in saves on the
  best) and m the number of other paths. Each path so spends at most EXPLORE_BUDGET / m of the
  time, all of them together EXPLORE_BUDGET (5%) of the average large save, as believed. One save
  explores at most one path: the most overdue (saves since its try / its spacing).
  Why spacing in proportion to the cost, rather than one save in 8 for every path (before
  2026-12-05: buffered-wb believed at 0.14 GB/s against 1 GB/s was tried one save in 32, each
  such save ~7x as long, ~20% on the average save), or only paths within a fixed factor: a path
  is not dropped for being slow (buffered was 0.45x of O_DIRECT at calibration and 2.5x of it
  two hours later), it is only tried as often as the budget pays for; a near path costs little
  and is tried often. The price is a slower discovery of a far path: "close" below.
  "Close", with the five paths here (m = 4): believed within 1/(1 + 10 * 0.05 / 4) = 0.89x of
  the best. Such a path is tried every <= 10 saves (a save later when another path falls due on
  the same ticket), so if it became 3x faster it is adopted within 10 saves; with two paths
  known (m = 1) close is within 0.67x. One believed 0.45x (2.2x slower, cost 1.22) is tried
  every 98 saves (two paths: 25); one believed 6x slower every 400. A belief that aged out keeps
  its figure for the cost (it is all we know).
- An emergency save always takes the best and never explores (it is timed by a signal's lead).
- `update` folds one real save into the belief; the best is recomputed at once, so a path that
  is now far faster is adopted from its first explored save.

`belief_of` also reads the older cache entries (strategy + probe GB/s, with or without a trial;
paths without `t` count as tried at the current ticket). The imperative shell (the cache file, its lock, the
ticket, rank 0's decision for the whole save) is in `calibrate`.
"""

from __future__ import annotations

import math
from typing import Any

ALPHA = 0.5  # weight of the newest save: the disk drifts 2x within the hour, saves are minutes apart
EXPLORE_EVERY = 8  # the fewest large saves between two tries of one path, however close it is
EXPLORE_BUDGET = 0.05  # exploring adds at most this fraction to the average large save (as believed)
AGE_OUT_S = 3 * 86400.0  # an older measurement no longer competes for the choice
PROBE = "probe"
SAVE = "save"


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _count(x: Any) -> int:
    return x if isinstance(x, int) and not isinstance(x, bool) and x >= 0 else 0


def belief_of(entry: Any, strategies: tuple[str, ...]) -> dict[str, Any] | None:
    """The bandit state of a cache entry: {"paths": {name: {gbps, at, n, src, t}}, "tickets": int},
    or None when the entry holds nothing usable (missing, damaged, stale in the old sense).
    Entries written before the bandit (strategy + probe gbps + measured_at) become a belief of
    probes. Pure; never raises."""
    if not isinstance(entry, dict):
        return None
    paths: dict[str, dict[str, Any]] = {}
    tickets = _count(entry.get("tickets"))
    raw = entry.get("paths")
    if isinstance(raw, dict):
        for name, p in raw.items():
            if name in strategies and isinstance(p, dict) and _number(p.get("gbps")) and _number(p.get("at")):
                paths[name] = {"gbps": float(p["gbps"]), "at": float(p["at"]), "n": _count(p.get("n")),
                               "src": SAVE if p.get("src") == SAVE else PROBE,
                               # a damaged `t` never blocks a path; none (a cache from before the
                               # spacing): tried now, or the first saves after an upgrade would try
                               # every path in turn, the slowest included
                               "t": min(_count(p["t"]), tickets) if "t" in p else tickets}
    elif not entry.get("stale") and isinstance(entry.get("gbps"), dict) and _number(entry.get("measured_at") or 1):
        at = float(entry.get("measured_at") or 1)
        for name, g in entry["gbps"].items():
            if name in strategies and _number(g):
                paths[name] = {"gbps": float(g), "at": at, "n": 0, "src": PROBE, "t": 0}
        if entry.get("strategy") in strategies and entry["strategy"] not in paths:
            paths[entry["strategy"]] = {"gbps": 1e-3, "at": at, "n": 0, "src": PROBE, "t": 0}
    if not paths:
        return None
    return {"paths": paths, "tickets": tickets}


def fresh(belief: dict[str, Any], now: float) -> dict[str, dict[str, Any]]:
    """The paths measured within AGE_OUT_S of `now` (a clock that stepped back counts as fresh)."""
    return {n: p for n, p in belief["paths"].items() if now - p["at"] <= AGE_OUT_S}


def best(belief: dict[str, Any], now: float) -> str | None:
    """The fastest fresh path; None when every measurement aged out (measure again)."""
    live = fresh(belief, now)
    return max(sorted(live), key=lambda n: live[n]["gbps"]) if live else None


def spacing(belief: dict[str, Any], now: float, name: str) -> int:
    """Large saves between two tries of `name`, a path other than the best: in proportion to the
    extra time a save on it is expected to take, so that trying every other path this often
    adds at most EXPLORE_BUDGET to the average save; never under EXPLORE_EVERY. Pure."""
    top = best(belief, now)
    paths = belief["paths"]
    if top is None or name == top:
        return EXPLORE_EVERY
    cost = max(0.0, float(paths[top]["gbps"]) / float(paths[name]["gbps"]) - 1)
    others = len(paths) - 1
    return max(EXPLORE_EVERY, math.ceil(round(others * cost / EXPLORE_BUDGET, 6)))


def _overdue(belief: dict[str, Any], now: float, ticket: int) -> list[tuple[float, str]]:
    """(saves since its last try / its spacing, name) of every path but the best, most overdue
    first (ties: the faster, then the name) for the save holding `ticket`."""
    top = best(belief, now)
    if top is None:
        return []
    paths = belief["paths"]
    scored = [((ticket + 1 - p.get("t", 0)) / spacing(belief, now, n), -p["gbps"], n) for n, p in paths.items()
              if n != top]
    return [(s, n) for s, _, n in sorted(scored, key=lambda x: (-x[0], x[1], x[2]))]


def due(belief: dict[str, Any], now: float, ticket: int) -> str | None:
    """The path the save holding `ticket` explores (the most overdue whose spacing has passed),
    or None: that save takes the best. Pure."""
    order = _overdue(belief, now, ticket)
    return order[0][1] if order and order[0][0] >= 1 else None


def pick(belief: dict[str, Any], now: float, *, emergency: bool, ticket: int | None) -> tuple[str | None, bool]:
    """(path, explored) for one save. `ticket`: this save's number on the file system, None for a
    save that may not explore (an emergency, a small shard). The best path, except when a path
    is `due` on this ticket. Pure."""
    top = best(belief, now)
    if emergency or ticket is None or top is None:
        return top, False
    path = due(belief, now, ticket)
    return (path, True) if path is not None else (top, False)


def draw(belief: dict[str, Any], now: float) -> tuple[str | None, dict[str, Any]]:
    """One large non-emergency save's ticket: (the path it explores or None, the belief with the
    counter moved on and that path marked tried, so that a save that fails or records nothing
    does not make the next one explore it again). Pure."""
    ticket, belief = take_ticket(belief)
    path, explored = pick(belief, now, emergency=False, ticket=ticket)
    if not explored or path is None:
        return None, belief
    paths = {**belief["paths"], path: {**belief["paths"][path], "t": belief["tickets"]}}
    return path, {**belief, "paths": paths}


def take_ticket(belief: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """(this save's ticket, the belief with the counter moved on). Pure."""
    return belief["tickets"], {**belief, "tickets": belief["tickets"] + 1}


def update(belief: dict[str, Any], strategy: str, gbps: float, now: float) -> dict[str, Any]:
    """The belief after one real save of `gbps` with `strategy` (pure): an EWMA with weight ALPHA
    on the newest save; the first real save replaces a probe's figure; a path never seen joins;
    the path counts as tried at the current ticket."""
    if not _number(gbps):
        return belief
    old = belief["paths"].get(strategy)
    if old is None or old["src"] != SAVE:
        speed = gbps
    else:
        speed = ALPHA * gbps + (1 - ALPHA) * old["gbps"]
    n = (old or {}).get("n", 0) + 1
    paths = {**belief["paths"], strategy: {"gbps": round(speed, 4), "at": now, "n": n, "src": SAVE,
                                           "t": belief["tickets"]}}
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


def next_exploration(belief: dict[str, Any], now: float) -> tuple[int, str] | None:
    """(how many large saves from now, the path) of the next exploration as things stand, or
    None (one path known, or nothing fresh). Pure."""
    top = best(belief, now)
    if top is None:
        return None
    c = belief["tickets"]  # the next save's ticket
    waits = [(max(0, p.get("t", 0) + spacing(belief, now, n) - 1 - c), -p["gbps"], n)
             for n, p in belief["paths"].items() if n != top]
    if not waits:
        return None
    wait, _, name = min(waits)
    return wait + 1, name


def describe(belief: dict[str, Any], now: float) -> str:
    """One line for `status`: each path's speed, age and how many real saves fed it, fastest
    first, the best marked, how often each other path is tried, and the next exploration."""
    top = best(belief, now)
    paths = belief["paths"]
    parts = []
    for n in sorted(paths, key=lambda n: -paths[n]["gbps"]):
        p = paths[n]
        fed = f"{p['n']} save(s)" if p["src"] == SAVE else "probe"
        aged = ", aged out" if now - p["at"] > AGE_OUT_S else ""
        every = f", tried 1 save in {spacing(belief, now, n)}" if top is not None and n != top else ""
        parts.append(f"{'*' if n == top else ''}{n} {p['gbps']:.2f} GB/s ({_age(now - p['at'])} ago, {fed}{aged}{every})")
    nxt = next_exploration(belief, now)
    tail = f"; the large save {nxt[0]} from now explores {nxt[1]}" if nxt else ""
    return "; ".join(parts) + tail

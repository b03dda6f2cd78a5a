"""Which write path (writer.STRATEGIES) is fastest on a file system: measured, cached, and kept
learning from real saves (`bandit`: the decisions; this module: the environment and the cache).

`choose(directory, size_hint)` answers, in this order:
  1. SLURMRESUME_WRITER=<strategy> forces one (tests, or a user who knows); `auto` or unset goes
     on. SLURMRESUME_NO_ODIRECT=1 forces `buffered`, =0 forces `direct` (the older switch).
  2. the belief for the file system in the cache file ($SLURMRESUME_WRITER_CACHE, default
     $XDG_CACHE_HOME/slurmresume/writer.json), keyed by host, st_dev, file-system type and mount
     point: one entry per disk as this node sees it. A large save (>= RECHECK_MIN_BYTES) that may
     explore takes a ticket from it under the cache's lock (`bandit.draw`: a path other than the
     best is tried once its `bandit.spacing` of saves has passed, at most 5% of the save time in
     all); in a Checkpointer's save rank 0 draws once (`save_ticket`) and every rank writes with
     the path it names (`agreed`). A small or emergency save reads the belief without the lock
     and takes the best (this process's memory when the file fails).
  3. a calibration when nothing fresh is known, but only for a shard of at least
     CALIBRATE_MIN_BYTES and never during an emergency save (`emergency()`): every strategy
     writes a probe file of PROBE_BYTES (SLURMRESUME_CALIBRATE_MIB) durably into the directory,
     ROUNDS interleaved rounds; the probes' speeds seed the belief. About a second on these
     disks; the cache file is locked meanwhile so the ranks of one node do not measure each other.
  4. otherwise `direct` (the best path on most days here), source "default".
After a large non-emergency save, `observe` folds its GB/s into the belief (`bandit.update`),
under the lock: the choice follows what real saves measure, those with a forced path included
(SLURMRESUME_WRITER: they are real saves of that path on this file system). An emergency save
never explores, never takes the lock and records nothing. `status` shows the belief (`cached_choice`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from . import bandit

log = logging.getLogger("slurmresume")

ENV = "SLURMRESUME_WRITER"
CACHE_ENV = "SLURMRESUME_WRITER_CACHE"
PROBE_ENV = "SLURMRESUME_CALIBRATE_MIB"
DEFAULT = "direct"
PROBE_BYTES = 128 << 20
ROUNDS = 2
PRUNE = 2.0
CALIBRATE_MIN_BYTES = 64 << 20
RECHECK_MIN_BYTES = 256 << 20  # a save at least this large explores and is recorded (a long enough sample)
MAX_CACHE_BYTES = 1 << 20  # a few hundred file systems' entries; a larger file is damaged, not read
_memo: dict[str, dict[str, Any]] = {}
_guard = threading.Lock()
_state = threading.local()
_warned: set[str] = set()


@contextlib.contextmanager
def emergency() -> Iterator[None]:
    """No calibration in this thread meanwhile: an emergency save uses what is known."""
    before = getattr(_state, "emergency", False)
    _state.emergency = True
    try:
        yield
    finally:
        _state.emergency = before


@contextlib.contextmanager
def agreed(explore: str) -> Iterator[None]:
    """In this thread meanwhile, large saves write with the path `explore` names (the whole
    save's decision, from rank 0's `save_ticket`; "": the best this node knows) instead of
    taking tickets of their own."""
    before = getattr(_state, "explore", None)
    _state.explore = explore
    try:
        yield
    finally:
        _state.explore = before


def save_ticket(directory: str | os.PathLike[str]) -> str:
    """Rank 0, once per large non-emergency save: take a ticket from the belief of `directory`'s
    file system and name the path this save explores on every rank (`bandit.draw`), "" for none.
    "" when nothing is known yet or anything fails (a hint never fails a save). One path for the
    whole save: the budget of `bandit.spacing` holds for the job, not only for rank 0's node."""
    if forced() is not None or getattr(_state, "emergency", False):
        return ""
    try:
        key = fs_key(directory)
        with _guard, _locked():
            entry = _read_cache().get(key)
            belief = _belief(entry)
            if belief is None or not isinstance(entry, dict):
                return ""
            now = time.time()
            path, belief = bandit.draw(belief, now)
            keep = {k: v for k, v in entry.items() if k in ("key", "measured_at", "calibration")}
            _write_cache(key, bandit.to_entry(belief, now, **keep))
        return path or ""
    except Exception:  # noqa: BLE001 - no exploration this time
        return ""


def cache_path() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "slurmresume" / "writer.json"


def fs_key(directory: str | os.PathLike[str]) -> str:
    """host:st_dev:fstype:mountpoint of the file system holding `directory`."""
    from .fsio import fs_type

    p = Path(directory)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        mounts = Path("/proc/mounts").read_text()
    except OSError:
        mounts = ""
    kind, mnt = fs_type(p, mounts)
    return f"{socket.gethostname()}:{os.stat(p).st_dev}:{kind}:{mnt}"


def forced() -> str | None:
    from .writer import STRATEGIES

    want = (os.environ.get(ENV) or "").strip()
    if want and want != "auto":
        if want in STRATEGIES:
            return want
        if want not in _warned:
            _warned.add(want)
            log.warning("%s=%s is not a write strategy (%s, auto): choosing by measurement", ENV, want,
                        ", ".join(STRATEGIES))
    legacy = os.environ.get("SLURMRESUME_NO_ODIRECT")
    return {"1": "buffered", "0": "direct"}.get(legacy or "")


def _read_cache() -> dict[str, Any]:
    """The cache's entries; {} (one warning per process and reason) when it is missing, unreadable,
    over MAX_CACHE_BYTES or not the JSON object we write. The cache is a speed hint: any failure
    to read it means the default path, never a failed save."""
    path = cache_path()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CACHE_BYTES + 1)
        if len(raw) > MAX_CACHE_BYTES:
            raise ValueError(f"over {MAX_CACHE_BYTES} bytes")
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
    except FileNotFoundError:
        return {}
    except Exception as exc:  # noqa: BLE001 - bad JSON, any depth (RecursionError), a directory, EACCES...
        _warn_once(f"ignoring the writer calibration cache {path} ({type(exc).__name__}: {exc}): using the "
                   f"default write path until it is rewritten; remove it, or set {CACHE_ENV} elsewhere")
        return {}
    return data


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def _write_cache(key: str, entry: dict[str, Any]) -> None:
    """Best effort, atomic (temp + rename): a cache that cannot be written costs a recalibration."""
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _read_cache()
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except Exception as exc:  # noqa: BLE001 - a read-only directory, a full disk: the hint is lost, not the save
        _warn_once(f"could not write the writer calibration cache {path}: {exc}")


def _belief(entry: Any) -> dict[str, Any] | None:
    from .writer import STRATEGIES

    return bandit.belief_of(entry, STRATEGIES)


def choose(directory: str | os.PathLike[str], size_hint: int = 0) -> tuple[str, str]:
    """(strategy, source) for a shard written into `directory`; source is "forced", "calibrated"
    (the best the belief knows), "explore" (a path tried by design, `bandit.pick`) or "default".
    Never raises: a failed calibration, or a cache that cannot be used, means the default (one
    warning)."""
    try:
        return _choose(directory, size_hint)
    except Exception as exc:  # noqa: BLE001 - a speed hint never fails a save (emergency ones included)
        _warn_once(f"choosing the write path in {directory} failed ({type(exc).__name__}: {exc}): using {DEFAULT}")
        return DEFAULT, "default"


def _choose(directory: str | os.PathLike[str], size_hint: int) -> tuple[str, str]:
    f = forced()
    if f is not None:
        return f, "forced"
    try:
        key = fs_key(directory)
    except OSError:
        return DEFAULT, "default"
    emergency_now = bool(getattr(_state, "emergency", False))
    now = time.time()
    if emergency_now or size_hint < RECHECK_MIN_BYTES:  # the best known, without the lock
        entry = _read_cache().get(key) or _memo.get(key)
        belief = _belief(entry)
        top = bandit.best(belief, now) if belief else None
        if top is not None:
            _memo[key] = entry  # type: ignore[assignment]
            return top, "calibrated"
        if size_hint < CALIBRATE_MIN_BYTES or emergency_now:
            return DEFAULT, "default"
    try:
        strategy, explored = _ticket_locked(Path(directory), key)
    except Exception as exc:  # noqa: BLE001 - the save goes on with the default path
        log.warning("write-path calibration in %s failed (%s): using %s", directory, exc, DEFAULT)
        return DEFAULT, "default"
    return strategy, "explore" if explored else "calibrated"


def _locked() -> Any:
    from filelock import FileLock

    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    return FileLock(str(path) + ".lock", timeout=120)


def _ticket_locked(directory: Path, key: str) -> tuple[str, bool]:
    """Under the cache's lock: the belief for `key` (calibrated now when nothing fresh is known),
    a ticket taken from it and the path it gets (`bandit.draw`; or the path the save agreed on,
    `agreed`), the entry written back."""
    with _guard, _locked():
        now = time.time()
        entry = _read_cache().get(key)
        belief = _belief(entry)
        if belief is None or bandit.best(belief, now) is None:
            probed = calibrate(directory)
            belief = _belief(probed)
            if belief is None:
                raise ValueError("the calibration measured no write path")
            entry = {"key": key, "measured_at": probed["measured_at"],
                     "calibration": {k: probed.get(k) for k in ("gbps", "seconds", "probe_bytes")}}
        else:
            belief = _probe_missing(directory, entry, belief, now)
        told = getattr(_state, "explore", None)  # the save's agreed path (`agreed`), else a ticket here
        if told is None:
            path, belief = bandit.draw(belief, now)
        else:
            from .writer import STRATEGIES

            path = told if told in STRATEGIES else None
        strategy, explored = (path, True) if path else (bandit.best(belief, now), False)
        entry = bandit.to_entry(belief, now, **{k: v for k, v in (entry or {}).items()
                                                if k in ("key", "measured_at", "calibration")})
        _write_cache(key, entry)
        _memo[key] = entry
    if explored:
        log.info("write path: exploring %s on this save (best known: %s)", strategy, entry["strategy"])
    return str(strategy), explored


def _probe_missing(directory: Path, entry: Any, belief: dict[str, Any], now: float) -> dict[str, Any]:
    """`belief` with a probe's figure for every write path that `entry`'s calibration predates (a
    path added by an upgrade, e.g. buffered-par: the bandit only ever tries paths with a figure,
    so without one it would wait for the belief to age out). Probed once, under the cache's lock,
    in a large non-emergency save; real saves then refine it. An entry without a calibration
    record (written by hand, or by a test) is taken as it is."""
    from .writer import STRATEGIES

    probed_then = ((entry or {}).get("calibration") or {}).get("gbps") if isinstance(entry, dict) else None
    if not isinstance(probed_then, dict):
        return belief
    missing = tuple(n for n in STRATEGIES if n not in belief["paths"] and n not in probed_then)
    if not missing:
        return belief
    try:
        probed = calibrate(directory, strategies=missing, rounds=1)
    except Exception as exc:  # noqa: BLE001 - the known paths still serve this save
        _warn_once(f"probing the write path(s) {', '.join(missing)} in {directory} failed: {exc}")
        return belief
    paths = dict(belief["paths"])
    for name, gbps in probed["gbps"].items():
        if name in missing:
            paths[name] = {"gbps": gbps, "at": now, "n": 0, "src": bandit.PROBE, "t": belief["tickets"]}
    return {**belief, "paths": paths}


def probe_bytes() -> int:
    try:
        return max(1, int(os.environ.get(PROBE_ENV, "") or PROBE_BYTES >> 20)) << 20
    except ValueError:
        return PROBE_BYTES


def calibrate(directory: Path, strategies: tuple[str, ...] | None = None, nbytes: int | None = None,
              rounds: int = ROUNDS) -> dict[str, Any]:
    """Write a probe of `nbytes` durably with each strategy, `rounds` interleaved rounds (the order
    rotates each round; a strategy over PRUNE x the fastest in round one is not measured again),
    in `directory`. Returns {strategy, gbps: {name: GB/s median},
    seconds: {name: [s, ...]}, probe_bytes, measured_at}."""
    import numpy as np

    from . import writer

    names: tuple[str, ...] = strategies or writer.STRATEGIES
    nbytes = nbytes or probe_bytes()
    src = np.frombuffer(os.urandom(min(nbytes, 8 << 20)), dtype=np.uint8)  # touched memory, like tensors
    times: dict[str, list[float]] = {n: [] for n in names}
    probe = directory / f".slurmresume-calibrate.{os.getpid()}.{threading.get_ident()}"
    try:
        for r in range(rounds):
            if r == 1:  # a path over PRUNE x the best after one round is out: less to write
                best_s = min(v[0] for v in times.values())
                names = tuple(n for n in names if times[n][0] <= PRUNE * best_s)
            for name in names[r % len(names):] + names[: r % len(names)]:
                times[name].append(time_probe(name, probe, src.data, nbytes))
                os.unlink(probe)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)
    med = {n: statistics.median(v) for n, v in times.items()}
    best = min(med, key=med.__getitem__)
    writer.release_staging(keep=best)
    gbps = {n: round(nbytes / s / 1e9, 3) for n, s in med.items()}
    entry: dict[str, Any] = {"strategy": best, "gbps": gbps,
                             "seconds": {n: [round(x, 4) for x in v] for n, v in times.items()},
                             "probe_bytes": nbytes, "measured_at": time.time()}
    log.info("write path for %s: %s (%s); real saves refine it", directory, best,
             ", ".join(f"{n} {g:.2f} GB/s" for n, g in gbps.items()))
    return entry


def time_probe(strategy: str, probe: Path, src: memoryview, nbytes: int) -> float:
    """Seconds to write `nbytes` (repeating `src`) durably to `probe` with `strategy`."""
    from . import writer

    t0 = time.perf_counter()
    sink = writer.ShardSink(probe, strategy=strategy)
    try:
        left = nbytes
        while left:
            n = min(left, len(src))
            sink.feed(src[:n])
            left -= n
        sink.finish()
    except BaseException:
        sink.abort()
        raise
    return time.perf_counter() - t0


def open_sink(path: str | os.PathLike[str], size_hint: int = 0, **where: Any) -> Any:
    """A writer.ShardSink for `path` with the strategy `choose` picks for its file system
    (`size_hint` bytes of a large shard allow a first calibration there, and exploring); a
    measured choice feeds `observe` when the sink finishes. The one place that joins the two
    modules: calibrate imports writer (to measure), never the other way round."""
    from .writer import ShardSink

    directory = os.path.dirname(os.path.abspath(path))
    strategy, source = choose(directory, size_hint)
    measured = source in ("calibrated", "explore", "forced")  # a forced path's real save is a measurement too
    on_finish = (lambda s, n, secs: observe(directory, s, n, secs)) if measured else None
    return ShardSink(path, strategy, source=source, on_finish=on_finish, **where)  # where: a node file's range


def observe(directory: str | os.PathLike[str], strategy: str, nbytes: int, seconds: float) -> None:
    """After a save with a measured or forced strategy: fold its GB/s into the file system's
    belief (`bandit.update`, under the cache's lock), when there is one (a forced path never
    calibrates). Not for small shards (RECHECK_MIN_BYTES: too short a sample) nor emergency
    saves (they never wait for a lock). Never raises."""
    if nbytes < RECHECK_MIN_BYTES or seconds <= 0 or getattr(_state, "emergency", False):
        return
    try:
        key = fs_key(directory)
        if _belief(_read_cache().get(key)) is None:  # nothing to refine (a forced path, never calibrated here)
            return
        with _guard, _locked():
            now = time.time()
            entry = _read_cache().get(key)
            belief = _belief(entry)
            if belief is None or not isinstance(entry, dict):
                return
            before = bandit.best(belief, now)
            belief = bandit.update(belief, strategy, nbytes / seconds / 1e9, now)
            keep = {k: v for k, v in entry.items() if k in ("key", "measured_at", "calibration")}
            after = bandit.to_entry(belief, now, **keep)
            _write_cache(key, after)
            _memo[key] = after
        if after["strategy"] != before:
            log.info("write path on %s is now %s, as real saves measure it: %s", key, after["strategy"],
                     bandit.describe(belief, now))
    except Exception:  # noqa: BLE001, S110 - after a save that worked: a lost observation costs nothing
        pass


def cached_choice(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What this node knows for `directory`'s file system (for `status`): {strategy, source, key,
    measured_at, gbps, belief, belief_line} or None."""
    f = forced()
    if f is not None:
        return {"strategy": f, "source": "forced"}
    try:
        key = fs_key(directory)
    except OSError:
        return None
    entry = _read_cache().get(key)
    belief = _belief(entry)
    if belief is None or not isinstance(entry, dict):
        return None
    now = time.time()
    return {"strategy": bandit.best(belief, now), "source": "measured", "key": key,
            "measured_at": entry.get("measured_at"), "gbps": {n: p["gbps"] for n, p in belief["paths"].items()},
            "belief": belief, "belief_line": bandit.describe(belief, now)}

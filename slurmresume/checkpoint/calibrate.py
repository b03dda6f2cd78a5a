"""Which write path (writer.STRATEGIES) is fastest on a file system: measured, cached, re-checked.

`choose(directory, size_hint)` answers, in this order:
  1. SLURMRESUME_WRITER=<strategy> forces one (tests, or a user who knows); `auto` or unset goes
     on. SLURMRESUME_NO_ODIRECT=1 forces `buffered`, =0 forces `direct` (the older switch).
  2. this process's memory of the file system, else the cache file
     ($SLURMRESUME_WRITER_CACHE, default $XDG_CACHE_HOME/slurmresume/writer.json), keyed by host,
     st_dev, file-system type and mount point: one entry per disk as this node sees it.
  3. a calibration, but only for a shard of at least CALIBRATE_MIN_BYTES and never during an
     emergency save (`emergency()`): every strategy writes a probe file of PROBE_BYTES
     (SLURMRESUME_CALIBRATE_MIB) durably into the directory, ROUNDS interleaved rounds, and the
     lowest median wins. About a second on these disks, once per node and file system; the cache
     file is locked meanwhile so the ranks of one node do not measure each other.
  4. otherwise `direct` (the best path on most days here), source "default".
A save that runs at under 1/SLOW_FACTOR of the speed its strategy was calibrated at (`observe`,
shards of at least RECHECK_MIN_BYTES, a calibration older than RECHECK_AFTER_S) marks the entry
stale: the next large save measures again.

Near-ties are settled by real saves. Probes are small, and a path that ties on 128 MiB can be
1.5x faster on a 4 GiB shard (buffered with writeback overlaps the page cache with the caller's
hashing; that pays off only on large files: docs/benchmarks.md, 2026-12-04). So when the
calibration finds other paths within TIE x the fastest probe, the entry holds a `trial`: the next
large (>= RECHECK_MIN_BYTES), non-emergency saves each use the contender with the fewest real
saves, `observe` records the GB/s each save reached, and once every contender has TRIAL_SAVES of
them the path with the best median of real saves becomes the choice (`settled_by: "saves"`). An
emergency save never explores: it uses the calibrated choice. Every step is in the cache file
and in `status`.
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
from typing import Any, TypeGuard

log = logging.getLogger("slurmresume")

ENV = "SLURMRESUME_WRITER"
CACHE_ENV = "SLURMRESUME_WRITER_CACHE"
PROBE_ENV = "SLURMRESUME_CALIBRATE_MIB"
DEFAULT = "direct"
PROBE_BYTES = 128 << 20
ROUNDS = 2
PRUNE = 2.0
CALIBRATE_MIN_BYTES = 64 << 20
RECHECK_MIN_BYTES = 256 << 20
SLOW_FACTOR = 3.0  # the disk here drifts 2x within an hour: that alone is no reason to measure again
RECHECK_AFTER_S = 600.0  # nor is a slow save right after a calibration (measuring costs ~1 GiB of writes)
TIE = 1.25  # probes within this factor of the fastest are settled by real saves
TRIAL_SAVES = 1  # real saves per contender before settling (each is a large shard: already a long sample)
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


def _valid(entry: Any) -> TypeGuard[dict[str, Any]]:
    from .writer import STRATEGIES

    if not (isinstance(entry, dict) and entry.get("strategy") in STRATEGIES and not entry.get("stale")):
        return False
    trial = entry.get("trial")
    if trial is None:
        return True
    # a damaged trial (hand-edited, truncated) would name a path no writer has, or fail to sort:
    # the entry is then no answer at all, and the next large save calibrates anew
    contenders, observed = (trial.get("contenders"), trial.get("observed")) if isinstance(trial, dict) else (None, None)
    return (isinstance(contenders, list) and bool(contenders) and all(c in STRATEGIES for c in contenders)
            and isinstance(observed, dict) and all(isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)
                                                   for v in observed.values()))


def choose(directory: str | os.PathLike[str], size_hint: int = 0) -> tuple[str, str]:
    """(strategy, source) for a shard written into `directory`; source is "forced", "calibrated"
    or "default". Never raises: a failed calibration, or a cache that cannot be used, means the
    default (one warning)."""
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
    entry = _memo.get(key)
    if _valid(entry) and entry.get("trial") and not emergency_now:
        entry = None  # a trial moves on with every node-local save: read what the other ranks recorded
    if not _valid(entry):
        entry = _read_cache().get(key)
        if _valid(entry):
            _memo[key] = entry
    if _valid(entry):
        if entry.get("trial") and not emergency_now and size_hint >= RECHECK_MIN_BYTES:
            return trial_pick(entry), "calibrated"
        return entry["strategy"], "calibrated"
    if size_hint < CALIBRATE_MIN_BYTES or emergency_now:
        return DEFAULT, "default"
    try:
        entry = _calibrate_locked(Path(directory), key)
    except Exception as exc:  # noqa: BLE001 - the save goes on with the default path
        log.warning("write-path calibration in %s failed (%s): using %s", directory, exc, DEFAULT)
        return DEFAULT, "default"
    _memo[key] = entry
    return entry["strategy"], "calibrated"


def _calibrate_locked(directory: Path, key: str) -> dict[str, Any]:
    from filelock import FileLock

    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with _guard, FileLock(str(path) + ".lock", timeout=120):
        entry = _read_cache().get(key)  # another rank of this node may have measured meanwhile
        if _valid(entry):
            return entry
        entry = calibrate(directory)
        entry["key"] = key
        _write_cache(key, entry)
    return entry


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
    contenders = sorted((n for n in med if med[n] <= TIE * med[best]), key=med.__getitem__)
    if len(contenders) > 1:
        entry["trial"] = {"contenders": contenders, "observed": {}}
    log.info("write path for %s: %s (%s)%s", directory, best,
             ", ".join(f"{n} {g:.2f} GB/s" for n, g in gbps.items()),
             f"; within {TIE}x: {', '.join(contenders)}, the next large saves decide" if len(contenders) > 1 else "")
    return entry


def trial_pick(entry: dict[str, Any]) -> str:
    """The contender of an open trial with the fewest real saves (ties: the faster probe first)."""
    trial = entry["trial"]
    observed = trial.get("observed") or {}
    return str(min(trial["contenders"], key=lambda n: (len(observed.get(n, [])), trial["contenders"].index(n))))


def settle(entry: dict[str, Any], strategy: str, gbps: float) -> dict[str, Any]:
    """The entry after one real save of `gbps` with `strategy` during its trial (pure): the
    observation recorded; once every contender has TRIAL_SAVES, the best median becomes the
    strategy and the trial closes (kept as `settled`, for status and the next reader)."""
    trial = entry["trial"]
    if strategy not in trial["contenders"]:
        return entry
    observed = {n: list(v) for n, v in (trial.get("observed") or {}).items()}
    observed.setdefault(strategy, []).append(round(gbps, 3))
    if any(len(observed.get(n, [])) < TRIAL_SAVES for n in trial["contenders"]):
        return {**entry, "trial": {**trial, "observed": observed}}
    rates = {n: statistics.median(observed[n]) for n in trial["contenders"]}
    best = max(rates, key=rates.__getitem__)
    out = {k: v for k, v in entry.items() if k != "trial"}
    out.update({"strategy": best, "settled_by": "saves", "settled": {"observed_gbps": observed, "at": time.time()}})
    return out


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


def observe(directory: str | os.PathLike[str], strategy: str, nbytes: int, seconds: float) -> None:
    """After a save with a calibrated strategy: mark the entry stale when it ran at under
    1/SLOW_FACTOR of its calibrated speed (the disk changed, or another path now wins) and the
    calibration is older than RECHECK_AFTER_S."""
    if nbytes < RECHECK_MIN_BYTES or seconds <= 0:
        return
    try:
        key = fs_key(directory)
        if not getattr(_state, "emergency", False) and _observe_trial(key, strategy, nbytes / seconds / 1e9):
            return
        entry = _memo.get(key) or _read_cache().get(key)
        if not _valid(entry) or entry["strategy"] != strategy:
            return
        expected = float(entry["gbps"][strategy])
        got = nbytes / seconds / 1e9
        young = time.time() - float(entry.get("measured_at") or 0) < RECHECK_AFTER_S
        if got * SLOW_FACTOR < expected and not young:
            log.warning("this save wrote %.2f GB/s with %s, calibrated at %.2f GB/s: measuring again next time",
                        got, strategy, expected)
            stale = {**entry, "stale": True, "stale_gbps": round(got, 3)}
            _memo.pop(key, None)
            _write_cache(key, stale)
    except Exception:  # noqa: BLE001, S110 - after a save that worked: a damaged hint costs a re-measure
        pass


def _observe_trial(key: str, strategy: str, gbps: float) -> bool:
    """Record a real save in this file system's open trial (under the cache's lock: the ranks of a
    node record their saves in one file). True when there was a trial to record in."""
    from filelock import FileLock

    path = cache_path()
    if not path.exists():
        return False
    with _guard, FileLock(str(path) + ".lock", timeout=30):
        entry = _read_cache().get(key)
        if not _valid(entry) or not entry.get("trial"):
            return False
        after = settle(entry, strategy, gbps)
        if after is entry:
            return False
        if "trial" not in after:
            log.info("write path settled by real saves: %s (GB/s %s)", after["strategy"],
                     after["settled"]["observed_gbps"])
        _write_cache(key, after)
        _memo[key] = after
    return True


def cached_choice(directory: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What this node knows for `directory`'s file system (for `status`): {strategy, source, key,
    measured_at, gbps, stale} or None."""
    f = forced()
    if f is not None:
        return {"strategy": f, "source": "forced"}
    try:
        key = fs_key(directory)
    except OSError:
        return None
    entry = _read_cache().get(key)
    if not isinstance(entry, dict):
        return None
    return {"strategy": entry.get("strategy"), "source": "calibrated", "key": key,
            "measured_at": entry.get("measured_at"), "gbps": entry.get("gbps"), "stale": bool(entry.get("stale")),
            "trial": entry.get("trial"), "settled_by": entry.get("settled_by", "probes"), "settled": entry.get("settled")}

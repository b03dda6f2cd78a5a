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
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
    except OSError as exc:
        log.warning("could not write the writer calibration cache %s: %s", path, exc)


def _valid(entry: Any) -> TypeGuard[dict[str, Any]]:
    from .writer import STRATEGIES

    return isinstance(entry, dict) and entry.get("strategy") in STRATEGIES and not entry.get("stale")


def choose(directory: str | os.PathLike[str], size_hint: int = 0) -> tuple[str, str]:
    """(strategy, source) for a shard written into `directory`; source is "forced", "calibrated"
    or "default". Never raises: a failed calibration means the default."""
    f = forced()
    if f is not None:
        return f, "forced"
    try:
        key = fs_key(directory)
    except OSError:
        return DEFAULT, "default"
    entry = _memo.get(key)
    if _valid(entry):
        return entry["strategy"], "calibrated"
    entry = _read_cache().get(key)
    if _valid(entry):
        _memo[key] = entry
        return entry["strategy"], "calibrated"
    if size_hint < CALIBRATE_MIN_BYTES or getattr(_state, "emergency", False):
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
    entry = {"strategy": best, "gbps": gbps,
             "seconds": {n: [round(x, 4) for x in v] for n, v in times.items()}, "probe_bytes": nbytes,
             "measured_at": time.time()}
    log.info("write path for %s: %s (%s)", directory, best,
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


def observe(directory: str | os.PathLike[str], strategy: str, nbytes: int, seconds: float) -> None:
    """After a save with a calibrated strategy: mark the entry stale when it ran at under
    1/SLOW_FACTOR of its calibrated speed (the disk changed, or another path now wins) and the
    calibration is older than RECHECK_AFTER_S."""
    if nbytes < RECHECK_MIN_BYTES or seconds <= 0:
        return
    try:
        key = fs_key(directory)
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
    except (OSError, KeyError, TypeError, ValueError):
        pass


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
            "measured_at": entry.get("measured_at"), "gbps": entry.get("gbps"), "stale": bool(entry.get("stale"))}

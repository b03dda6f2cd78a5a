"""Save/restore benchmark: slurmresume against the disk's own limits and the peers, in one run.

    python scripts/bench.py --sizes 1,4 --rounds 5 --dir /work/bench --json-out bench.json

For each state size (GiB of a transformer-like mix of large and small tensors) it runs every
method once per round, --rounds rounds (at least 5), the order rotating each round and the page
cache dropped (as root) before each method, so that a disk whose speed drifts within the hour
hits every method alike:
  physical limits: O_DIRECT write + fsync, buffered write + fdatasync (each with one stream,
                   and with 2 threads writing the two halves of the file), read (cold and page
                   cache), memory copy of the state into touched buffers
  peers:           torch.save + fsync, safetensors save_file + fsync, DCP save with
                   FileSystemWriter(thread_count=1, 2, 4, sync_files=True) and no process group
                   (no_dist: one process saving, as a user without torchrun would), DCP async_save
  slurmresume:     sync save to a durable commit with the calibrated write path (the
                   calibration runs once before timing, as a first large save would), the same
                   with each write path forced, async save (blocking / total), restore (the
                   default staged one, cold and from the page cache; the two-pass one, cold)
  memory:          touching fresh memory of the state's size (what the staged restore adds; its
                   share of our cold restore is printed, so the restore's gap has a name)
It prints, per method, the median, min-max and IQR over the rounds, and for each slurmresume
save the best peer's seconds / ours, round by round: median and min-max of that ratio, saying
when the spread straddles 1.0. Also: peak extra RSS of each save, `find_latest` among 10,000
step directories and the per-step preemption agreement with 2 gloo ranks (skip with --quick).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import slurmresume  # noqa: E402
from slurmresume.checkpoint.store import find_latest  # noqa: E402
from slurmresume.contract import ENV_RESTORE_STAGING  # noqa: E402

GiB = 1 << 30


def forcing(strategy: str | None, work: Path) -> None:
    """Force `strategy` (None: choose) for the next save. A forced save feeds the belief of the
    cache it sees (issue #32): the forced rows get a cache of their own, so that the chosen row
    learns only from its own saves, as a run with no forced saves would, and the table still shows
    whether the choice or the path lost."""
    from slurmresume.checkpoint import calibrate

    if strategy:
        os.environ[calibrate.ENV] = strategy
        os.environ[calibrate.CACHE_ENV] = str(work / "writer-cache-forced.json")
    else:
        os.environ.pop(calibrate.ENV, None)
        os.environ[calibrate.CACHE_ENV] = str(work / "writer-cache.json")


def make_state(gib: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Embedding + layers of attention/MLP matrices + many small norm/bias vectors."""
    d = 2048 if gib >= 0.25 else 256  # narrower below 1/4 GiB: a smoke run of a few MiB
    item = torch.tensor([], dtype=dtype).element_size()
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {"embed.weight": torch.randn(16384, d, generator=g).to(dtype)}
    i = 0
    while sum(t.numel() for t in state.values()) * item < gib * GiB:
        for name, shape in (("attn.qkv", (3 * d, d)), ("attn.out", (d, d)), ("mlp.up", (4 * d, d)),
                            ("mlp.down", (d, 4 * d)), ("ln1", (d,)), ("ln2", (d,)), ("mlp.bias", (4 * d,))):
            state[f"layers.{i}.{name}"] = torch.randn(*shape, generator=g).to(dtype)
        i += 1
    return state


class Holder:
    """A stateful object over a dict of tensors (what a model is to the checkpointer)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        for k, v in sd.items():
            self.tensors[k].copy_(v)


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_hwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


KEEP_PAGE_CACHE = False  # --keep-page-cache: never drop it (a smoke run on a shared machine)


def drop_caches() -> bool:
    if KEEP_PAGE_CACHE:
        return False
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3")
        return True
    except OSError:
        return False


def fsync_path(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def raw_write(path: Path, nbytes: int, direct: bool, streams: int = 1) -> None:
    """`nbytes` of one touched 64 MiB buffer (per stream) written to `path` and made durable;
    with `streams` > 1, that many threads each write their own contiguous part of the file with
    pwrite (the limit of parallel writers on one file)."""
    import threading

    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o644)
    part = -(-nbytes // streams // 4096) * 4096

    size = min(64 << 20, part)

    def write(lo: int, hi: int) -> None:
        buf = mmap.mmap(-1, size)
        buf.write(b"\x5a" * size)
        at = lo
        while at < hi:
            at += os.pwrite(fd, memoryview(buf)[: min(len(buf), -(-(hi - at) // 4096) * 4096)], at)

    threads = [threading.Thread(target=write, args=(i * part, min(nbytes, (i + 1) * part))) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.ftruncate(fd, nbytes)
    os.fsync(fd) if direct else os.fdatasync(fd)
    os.close(fd)


def raw_read(path: Path) -> None:
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(64 << 20)
        while f.readinto(buf):
            pass


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


DCP_THREADS = (1, 2, 4)
PEERS = ("torch.save + fsync", "safetensors save_file + fsync", *(f"DCP save t{t}" for t in DCP_THREADS),
         "DCP async_save total")
FRESH = "touch fresh memory of the state's size"
OURS = "slurmresume save (durable commit)"


def dcp_threads(state: dict[str, torch.Tensor], path: Path, threads: int) -> None:
    """DCP's save with `threads` writer threads (one file each) and fsync, in one process with no
    process group (`no_dist`), as torch 2.13 allows."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"m": state}, storage_writer=FileSystemWriter(str(path), thread_count=threads, sync_files=True),
                 no_dist=True)


def bench_size(gib: float, dtype: torch.dtype, rounds: int, work: Path, partial: Path | None = None,
               saves_only: bool = False) -> dict:
    """Every method once per round, in an order that rotates each round, the page cache dropped
    (when allowed) before each one, so that a disk that drifts within the hour hits all methods
    alike; the round-to-round spread is reported with each median."""
    from slurmresume.checkpoint import calibrate, writer

    state = make_state(gib, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    largest = max(t.numel() * t.element_size() for t in state.values())
    results: dict[str, list[float]] = {}
    memory: dict[str, int] = {}

    def record(name: str, seconds: float) -> None:
        results.setdefault(name, []).append(seconds)

    def fresh(name: str) -> Path:
        p = work / name
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        return p

    def with_mem(name: str, fn: Callable[[], object]) -> float:
        reset_hwm()
        base = rss()
        s = timed(fn)
        memory[name] = max(memory.get(name, 0), hwm() - base)
        return s

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    # --saves-only: no second copy of the state (the restore's target): a 4 GiB run in ~half the memory
    copies = {} if saves_only else {k: torch.empty_like(v) for k, v in state.items()}
    for v in copies.values():
        v.zero_()
    # the write-path calibration a first large save would run, done before timing starts
    os.environ[calibrate.CACHE_ENV] = str(work / "writer-cache.json")
    fresh("ours")
    t0 = time.perf_counter()
    chosen = calibrate.choose(work / "ours", size_hint=nbytes)
    calibration = {"choice": chosen[0], "seconds": round(time.perf_counter() - t0, 3),
                   "entry": calibrate.cached_choice(work / "ours")}
    ck = slurmresume.Checkpointer(work / "ours", handle_signals=False)
    ack = slurmresume.Checkpointer(work / "ours_async", handle_signals=False)
    counter = iter(range(1, 1 << 30))
    writers: list[str | None] = []
    breakdowns: dict[str, list[dict]] = {}  # per slurmresume save method: each timed save's breakdown

    def ours(strategy: str | None) -> Callable[[], None]:
        def run() -> None:
            forcing(strategy, work)
            drop_steps(work / "ours")
            name = OURS if strategy is None else f"slurmresume save, writer={strategy}"
            try:
                record(name, with_mem(name, lambda: ck.save(next(counter), {"m": Holder(state)})))
                saved = last_saved(work / "ours")
                breakdowns.setdefault(name, []).append(saved.get("breakdown") or {})
                if strategy is None:  # the path this save took (the choice keeps learning from real saves)
                    writers.append(saved.get("writer"))
            finally:
                forcing(None, work)
        return run

    def dcp_async() -> None:
        d = fresh("dcp_async")
        t0 = time.perf_counter()
        with warnings.catch_warnings():  # no process group: "assuming ... a single process", as it is
            warnings.simplefilter("ignore", UserWarning)
            fut = dcp.async_save({"m": state}, checkpoint_id=str(d), no_dist=True)
        record("DCP async_save blocking", time.perf_counter() - t0)
        fut.result()
        record("DCP async_save total", time.perf_counter() - t0)

    def ours_async() -> None:
        drop_steps(work / "ours_async")
        t0 = time.perf_counter()
        reset_hwm()
        base = rss()
        ack.save_async(next(counter), {"m": Holder(state)})
        blocking = time.perf_counter() - t0
        ack.wait()
        total = time.perf_counter() - t0
        memory["slurmresume async (with buffers)"] = max(memory.get("slurmresume async (with buffers)", 0), hwm() - base)
        record("slurmresume async blocking", blocking)
        record("slurmresume async total", total)

    def dcp_peer(threads: int) -> Callable[[], None]:
        name = f"DCP save t{threads}"
        return lambda: record(name, with_mem(name, lambda: dcp_threads(state, fresh("dcp"), threads)))

    def raw_reads() -> None:
        raw_write(fresh("raw") / "f", nbytes, True)
        cold = drop_caches()
        record("raw read (cold)" if cold else "raw read", timed(lambda: raw_read(work / "raw" / "f")))
        record("raw read (page cache)", timed(lambda: raw_read(work / "raw" / "f")))

    def restore() -> None:
        if not (work / "ours").is_dir():
            ours(None)()
        for v in copies.values():
            v.zero_()
        target = Holder(copies)  # reuse the copy buffers: a 4 GiB run must fit in 24 GiB

        opened: list[slurmresume.Checkpointer] = []

        def load() -> None:
            opened.append(slurmresume.Checkpointer(work / "ours", handle_signals=False))
            opened[-1].restore({"m": target})

        def two_passes() -> None:  # verify, then a verified read into the live tensors: no staging memory
            os.environ[ENV_RESTORE_STAGING] = "0"
            try:
                load()
            finally:
                os.environ.pop(ENV_RESTORE_STAGING, None)

        cold = drop_caches()
        try:
            record("slurmresume restore (cold)" if cold else "slurmresume restore", timed(load))
            record("slurmresume restore (page cache)", timed(load))
            cold = drop_caches()
            record("slurmresume restore, two passes (cold)" if cold else "slurmresume restore, two passes",
                   timed(two_passes))
        finally:  # closed, after the timing: an open one keeps refreshing the root's lease, and the next
            for c in opened:  # size's Checkpointer on the same root was then "taken over" (2026-12-05)
                c.close()
        assert all(torch.equal(target.tensors[k], state[k]) for k in list(state)[:3])
        # the peer: safetensors load_file (mmap) + copy into the same model, page cache dropped first
        from safetensors.torch import load_file

        peer_file = work / "restore_peer.st"
        if not peer_file.exists():
            save_file(state, str(peer_file))

        def peer_load() -> None:
            for k, v in load_file(str(peer_file)).items():
                copies[k].copy_(v)

        cold = drop_caches()
        record("safetensors load_file + copy (cold)" if cold else "safetensors load_file + copy", timed(peer_load))
        # what the default (staged) restore pays beyond the read: touching as much fresh memory as
        # it stages (on a VM whose host backs guest memory lazily this alone can exceed the read)
        record(FRESH, timed(lambda: torch.empty(nbytes, dtype=torch.uint8).fill_(1)))

    def memory_copy() -> None:
        record("memory copy of the state", timed(lambda: [copies[k].copy_(v) for k, v in state.items()]))

    methods: list[Callable[[], None]] = [
        lambda: record("raw O_DIRECT write+fsync", timed(lambda: raw_write(fresh("raw") / "f", nbytes, True))),
        lambda: record("raw buffered write+fdatasync", timed(lambda: raw_write(fresh("raw") / "f", nbytes, False))),
        lambda: record("raw O_DIRECT write+fsync, 2 streams",
                       timed(lambda: raw_write(fresh("raw") / "f", nbytes, True, streams=2))),
        lambda: record("raw buffered write+fdatasync, 2 streams",
                       timed(lambda: raw_write(fresh("raw") / "f", nbytes, False, streams=2))),
        memory_copy,
        lambda: record("torch.save + fsync", with_mem("torch.save + fsync", lambda: (
            torch.save(state, fresh("torch_save") / "s.pt"), fsync_path(work / "torch_save" / "s.pt")))),
        lambda: record("safetensors save_file + fsync", with_mem("safetensors save_file + fsync", lambda: (
            save_file(state, str(fresh("save_file") / "s.st")), fsync_path(work / "save_file" / "s.st")))),
        *(dcp_peer(t) for t in DCP_THREADS),
        dcp_async,
        ours(None),
        *(ours(s) for s in writer.STRATEGIES),
        ours_async,
        raw_reads,
    ]
    if saves_only:  # the durable saves alone: no memory copy, no async save (each stages a copy), no reads
        dropped = {memory_copy, dcp_async, ours_async, raw_reads}
        methods = [m for m in methods if m not in dropped]
    else:
        ours_async()  # the first async call allocates the reused snapshot buffers: not timed
    ours(None)()  # and the first sync save pays one-time costs (imports, staging buffers): not timed
    results.clear()
    memory.clear()
    writers.clear()
    breakdowns.clear()
    for r in range(rounds):
        k = r % len(methods)
        for m in methods[k:] + methods[:k]:
            drop_caches()
            m()
        if not saves_only:
            restore()
        print(f"  {gib} GiB round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
        if partial is not None:  # the finished rounds, should the run be stopped before the size is done
            partial.write_text(json.dumps({"gib": gib, "rounds_done": r + 1, "date": time.strftime(
                "%Y-%m-%d %H:%M UTC", time.gmtime()), "all": results, "writers": writers}, indent=1))
    ack.close()
    ck.close()
    for name in ("raw", "torch_save", "save_file", "dcp", "dcp_async", "ours", "ours_async"):
        shutil.rmtree(work / name, ignore_errors=True)
    (work / "restore_peer.st").unlink(missing_ok=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    return {"gib": gib, "bytes": nbytes, "largest_tensor_bytes": largest, "dtype": str(dtype), "rounds": rounds,
            "seconds": med, "all": results, "peak_extra_bytes": memory, "calibration": calibration,
            "writers": writers, "calibration_end": calibrate.cached_choice(work / "ours"), "breakdowns": breakdowns}


def drop_steps(root: Path) -> None:
    """Remove the previous round's checkpoints but not the root: its lease (.owner.json, rewritten
    by the open Checkpointer's heartbeat) and event log stay, as in a real run."""
    for child in root.glob("step_*"):
        shutil.rmtree(child, ignore_errors=True)


def last_saved(root: Path) -> dict:
    """The newest `save_committed` event under `root` (its writer and breakdown); {} when none."""
    try:
        lines = (root / "events.jsonl").read_text().splitlines()
    except OSError:
        return {}
    for line in reversed(lines):
        e = json.loads(line)
        if e.get("event") == "save_committed":
            return e
    return {}


BREAKDOWN = ("shard_gbps", "shard_s", "write_calls_s", "hash_s", "fsync_s", "wait_s", "rank_write_s", "commit_s",
             "collective_s", "prepare_s")


def breakdown_rows(r: dict) -> list[str]:
    """Per slurmresume save method, the median over the rounds of each part of its breakdown
    (slurmresume.train.breakdown): a regression then has a name."""
    rows = [f"| {'save, median over rounds':40s} | " + " | ".join(f"{k.removesuffix('_s'):>10s}" for k in BREAKDOWN) + " |"]
    rows.append(f"|{'-' * 42}|" + "|".join("-" * 12 for _ in BREAKDOWN) + "|")
    for name, saves in sorted((r.get("breakdowns") or {}).items()):
        cells = []
        for k in BREAKDOWN:
            vals = [b[k] for b in saves if isinstance(b.get(k), (int, float))]
            cells.append(f"{statistics.median(vals):10.3f}" if vals else f"{'-':>10s}")
        rows.append(f"| {name:40s} | " + " | ".join(cells) + " |")
    return rows


def spread(values: list[float]) -> tuple[float, float, float, float]:
    """(median, min, max, IQR) of the rounds."""
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return statistics.median(values), min(values), max(values), q[2] - q[0]


def ratio_to_best_peer(r: dict, name: str = OURS) -> dict:
    """Per round: the best peer's seconds (best by median) / ours, so > 1 means we are faster.
    Median and min-max of those round-to-round ratios; `straddles` when min < 1 < max."""
    peers = {k: statistics.median(r["all"][k]) for k in PEERS if k in r["all"]}
    best = min(peers, key=peers.__getitem__)
    per_round = [p / o for p, o in zip(r["all"][best], r["all"][name], strict=False)]
    return {"best_peer": best, "ratios": per_round, "median": statistics.median(per_round), "min": min(per_round),
            "max": max(per_round), "straddles": min(per_round) < 1.0 < max(per_round),
            "median_of_ours_le_best_peer": statistics.median(r["all"][name]) <= peers[best]}


RANK_PEERS = ("torch.save + fsync", "safetensors save_file + fsync", "DCP save")


def bench_ranks(gib: float, dtype: torch.dtype, rounds: int, work: Path, ranks: int) -> dict:
    """`ranks` processes on this machine each save their own `gib` GiB state at once (different
    values per rank, and names per rank for DCP: nothing is deduplicated), every method once per
    round in a rotating order, the page cache dropped before each; a method's time is from a barrier before to a
    barrier after (the slowest rank)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = 27000 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank_worker, args=(r, ranks, port, gib, dtype, rounds, str(work), q))
             for r in range(ranks)]
    for p in procs:
        p.start()
    out = q.get()
    for p in procs:
        p.join()
    return out


def _rank_worker(rank: int, ranks: int, port: int, gib: float, dtype: torch.dtype, rounds: int, work_s: str,
                 q) -> None:  # noqa: ANN001
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    from slurmresume.checkpoint import calibrate, writer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    torch.manual_seed(rank)
    state = {k: v + rank for k, v in make_state(gib, dtype).items()}
    # DCP deduplicates plain tensors of the same name across ranks (they look replicated to it) and
    # would write one rank's bytes for both (losing the others'): it gets each rank's own names
    named = {f"rank{rank}.{k}": v for k, v in state.items()}
    work = Path(work_s)
    mine = work / f"rank{rank}"
    mine.mkdir(parents=True, exist_ok=True)
    os.environ[calibrate.CACHE_ENV] = str(work / "writer-cache.json")
    ck = slurmresume.Checkpointer(work / "ours", handle_signals=False)
    counter = iter(range(1, 1 << 30))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    def ours(strategy: str | None) -> Callable[[], None]:
        def run() -> None:
            forcing(strategy, work)
            try:
                ck.save(next(counter), {"m": Holder(state)})
            finally:
                forcing(None, work)
        return run

    def clean() -> None:
        if rank == 0:
            drop_steps(work / "ours")
        for child in mine.iterdir():
            shutil.rmtree(child) if child.is_dir() else child.unlink()
        shutil.rmtree(work / "dcp", ignore_errors=True) if rank == 0 else None

    methods: dict[str, Callable[[], object]] = {
        "raw O_DIRECT write+fsync": lambda: raw_write(mine / "f", nbytes, True),
        "raw buffered write+fdatasync": lambda: raw_write(mine / "f", nbytes, False),
        "torch.save + fsync": lambda: (torch.save(state, mine / "s.pt"), fsync_path(mine / "s.pt")),
        "safetensors save_file + fsync": lambda: (save_file(state, str(mine / "s.st")), fsync_path(mine / "s.st")),
        "DCP save": lambda: dcp.save({"m": named}, checkpoint_id=str(work / "dcp")),
        OURS: ours(None),
        **{f"slurmresume save, writer={s}": ours(s) for s in writer.STRATEGIES},
    }
    ours(None)()  # the first save calibrates and pays one-time costs: not timed
    results: dict[str, list[float]] = {}
    breakdowns: dict[str, list[dict]] = {}
    names = list(methods)
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            clean()
            dist.barrier()
            if rank == 0:
                drop_caches()
            dist.barrier()
            t0 = time.perf_counter()
            methods[name]()
            dist.barrier()
            results.setdefault(name, []).append(time.perf_counter() - t0)
            if name.startswith("slurmresume") and rank == 0:
                breakdowns.setdefault(name, []).append(last_saved(work / "ours").get("breakdown") or {})
        if rank == 0:
            print(f"  {ranks} x {gib} GiB round {r + 1}/{rounds} done", file=sys.stderr, flush=True)
    ck.close()
    if rank == 0:
        med = {k: statistics.median(v) for k, v in results.items()}
        q.put({"gib": gib, "ranks": ranks, "bytes": nbytes * ranks, "largest_tensor_bytes": 0, "dtype": str(dtype),
               "rounds": rounds, "seconds": med, "all": results, "peak_extra_bytes": {}, "breakdowns": breakdowns,
               "calibration": {"choice": "-", "seconds": 0.0,
                               "entry": calibrate.cached_choice(work / "ours")},
               "calibration_end": calibrate.cached_choice(work / "ours"), "writers": []})
    dist.destroy_process_group()


def bench_scan(work: Path, n: int = 10_000) -> dict:
    root = work / "scan"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    small = slurmresume.Checkpointer(root / "_src", handle_signals=False)
    small.save(0, {"x": torch.zeros(4)})
    template = root / "_src" / "step_000000000"
    from slurmresume.checkpoint.jsonenc import dumps
    from slurmresume.checkpoint.manifest import marker_bytes

    manifest = json.loads((template / "manifest.json").read_text())
    shard = next(template.glob("rank-*"))
    for step in range(1, n + 1):
        d = root / f"step_{step:09d}"
        d.mkdir()
        os.link(shard, d / shard.name)
        if step <= n - 3:  # the three newest are incomplete (no marker), as after a kill
            raw = dumps({**manifest, "step": step}).encode()
            (d / "manifest.json").write_bytes(raw)
            (d / "COMMITTED").write_bytes(marker_bytes(step, raw))
    cold = drop_caches()
    cold_s = timed(lambda: find_latest(root, warn=False)) if cold else None
    times = [timed(lambda: find_latest(root, warn=False)) for _ in range(5)]
    found = find_latest(root, warn=False)
    assert found is not None and found.step == n - 3
    return {"directories": n, "find_latest_warm_s": statistics.median(times), "find_latest_cold_s": cold_s}


def bench_agreement(iters: int = 2000) -> dict:
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").SimpleQueue()
    port = 29000 + os.getpid() % 2000
    procs = [mp.get_context("spawn").Process(target=_agree_worker, args=(r, port, iters, q)) for r in range(2)]
    for p in procs:
        p.start()
    vals = [q.get() for _ in procs]
    for p in procs:
        p.join()
    us = max(v[0] for v in vals)
    return {"per_step_us": us, "percent_of_50ms_step": us / 50_000 * 100,
            "blocking_allreduce_us": max(v[1] for v in vals)}


def _agree_worker(rank: int, port: int, iters: int, q) -> None:  # noqa: ANN001
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from slurmresume.checkpoint.collective import Group, LaggedMax

    g = Group.create()
    lagged = LaggedMax(g)
    blocking, lagged_s = [], []
    for _ in range(iters):  # a 2 ms "training step" between checks, as in a real loop
        time.sleep(0.002)
        t = time.perf_counter()
        g.max_int(0)
        blocking.append(time.perf_counter() - t)
        time.sleep(0.002)
        t = time.perf_counter()
        lagged.exchange(0)
        lagged_s.append(time.perf_counter() - t)
    lagged.drain()
    q.put((statistics.median(lagged_s) * 1e6, statistics.median(blocking) * 1e6))
    dist.destroy_process_group()


def fresh_memory_line(r: dict) -> str:
    """Our cold restore against the peer's, and how much of ours touching fresh memory of the
    state's size takes (the staged, all-or-nothing restore holds every verified byte in fresh
    memory: on a VM that backs guest pages lazily that, not our reading, is the gap)."""
    s = r["seconds"]
    ours = next((s[k] for k in ("slurmresume restore (cold)", "slurmresume restore") if k in s), None)
    peer = next((s[k] for k in ("safetensors load_file + copy (cold)", "safetensors load_file + copy") if k in s), None)
    fresh = s.get(FRESH)
    if ours is None or peer is None or fresh is None:
        return "restore: not measured"
    return (f"restore: ours {ours:.3f} s, load_file + copy {peer:.3f} s (peer/ours {peer / ours:.2f}x); touching fresh "
            f"memory of the state's size {fresh:.3f} s = {fresh / ours:.0%} of our restore; ours without it "
            f"{max(ours - fresh, 0.0):.3f} s")


def report(sizes: list[dict], scan: dict | None, agree: dict | None) -> None:
    for r in sizes:
        s = r["seconds"]
        gb = r["bytes"] / 1e9
        best_raw = min(v for k, v in s.items() if k.startswith("raw") and "write" in k)
        best_peer = min(v for k, v in s.items() if k in PEERS)
        cal = r["calibration"]
        print(f"\n## {str(r['ranks']) + ' ranks saving at once, each ' if r.get('ranks', 1) > 1 else ''}{r['gib']} GiB state ({r['dtype']}, {r['bytes'] / GiB:.2f} GiB, largest tensor "
              f"{r['largest_tensor_bytes'] / 2**20:.0f} MiB), {r['rounds']} interleaved rounds, page cache dropped "
              "before each method")
        print(f"write-path calibration: chose {cal['choice']} in {cal['seconds']:.2f} s "
              f"(belief: {(cal.get('entry') or {}).get('belief_line')})")
        end = r.get("calibration_end") or {}
        if r.get("writers"):
            print(f"timed '{OURS}' saves, round by round, wrote with: {', '.join(map(str, r['writers']))}; "
                  f"belief at the end: {end.get('belief_line')}")
        print(f"| {'method':40s} | {'median s':>8s} | {'min-max s':>13s} | {'IQR s':>6s} | {'GB/s':>5s} | "
              f"{'raw/it':>6s} | {'peer/it':>7s} | {'peak extra MiB':>14s} |")
        print(f"|{'-' * 42}|{'-' * 10}|{'-' * 15}|{'-' * 8}|{'-' * 7}|{'-' * 8}|{'-' * 9}|{'-' * 16}|")
        for k in sorted(s, key=lambda k: (k.startswith("slurmresume"), k not in PEERS, s[k])):
            med, lo, hi, iqr = spread(r["all"][k])
            mem = r["peak_extra_bytes"].get(k)
            print(f"| {k:40s} | {med:8.3f} | {lo:6.2f}-{hi:6.2f} | {iqr:6.3f} | {gb / med:5.2f} | {best_raw / med:6.2f} | "
                  f"{best_peer / med:7.2f} | {(mem / 2**20 if mem is not None else float('nan')):14.0f} |")
        for name in [OURS] + [k for k in s if k.startswith("slurmresume save, writer=")]:
            q = ratio_to_best_peer(r, name)
            note = ("  THE SPREAD STRADDLES 1.0: not a clear win or loss" if q["straddles"] else "")
            print(f"{name}: best peer ({q['best_peer']}) / ours per round: median {q['median']:.2f}x, "
                  f"min-max {q['min']:.2f}-{q['max']:.2f}x; median ours <= median best peer: "
                  f"{q['median_of_ours_le_best_peer']}{note}")
            print(f"  per round: {', '.join(f'{x:.2f}' for x in q['ratios'])}")
        print(fresh_memory_line(r))
        print("\nwhere our saves' seconds went (shard GB/s; seconds: the slowest rank's shard, its write calls, "
              "hashing, fsync, waiting for the writer; the rank's whole write; manifest+marker+publish; "
              "collectives; prepare):")
        print("\n".join(breakdown_rows(r)))
    if scan:
        print(f"\nfind_latest among {scan['directories']} step directories (warm): {scan['find_latest_warm_s'] * 1e3:.1f} ms")
    if agree:
        print(f"per-step preemption agreement, 2 gloo ranks (pipelined, as used): {agree['per_step_us']:.0f} us "
              f"= {agree['percent_of_50ms_step']:.3f}% of a 50 ms step; a blocking all-reduce would cost "
              f"{agree['blocking_allreduce_us']:.0f} us")


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default in --help."""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=_Help)
    ap.add_argument("--sizes", default="1", help="GiB, comma separated (e.g. 1,4)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="state dtype")
    ap.add_argument("--rounds", "--repeats", dest="rounds", type=int, default=5,
                    help="interleaved rounds, at least 5 for a spread worth reading")
    ap.add_argument("--quick", action="store_true", help="skip the directory scan and the agreement benchmark")
    ap.add_argument("--ranks", type=int, default=1,
                    help="processes saving at once, each its own state of each size (2: 2 x 1 GiB); over 1 runs "
                         "only the write paths, the peers that save per rank and DCP, and implies --quick")
    ap.add_argument("--dir", default=None, help="benchmark directory; none: a temp dir under /tmp")
    ap.add_argument("--json-out", default=None, help="also write every figure there as JSON")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="never drop the page cache (smoke runs on a shared machine; the figures are not cold)")
    ap.add_argument("--saves-only", action="store_true",
                    help="time the durable saves alone (raw writes, peers, ours): no async saves, reads or "
                         "restore, and no second copy of the state (about half the memory)")
    args = ap.parse_args()
    global KEEP_PAGE_CACHE
    KEEP_PAGE_CACHE = args.keep_page_cache
    if args.rounds < 1:
        ap.error("--rounds must be at least 1 (5 or more for a spread worth reading)")
    work = Path(args.dir or tempfile.mkdtemp(prefix="slurmresume-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.ranks > 1:
        sizes = [bench_ranks(float(s), getattr(torch, args.dtype), args.rounds, work, args.ranks)
                 for s in args.sizes.split(",")]
        for r in sizes:
            r["ratio_to_best_peer"] = {k: ratio_to_best_peer(r, k) for k in r["all"]
                                       if k == OURS or k.startswith("slurmresume save, writer=")}
        report(sizes, None, None)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                                       "sizes": sizes}, indent=2))
        shutil.rmtree(work, ignore_errors=True) if not args.dir else None
        return
    # no process group: one process saving, every method alike (DCP's with no_dist, as torch 2.13 allows)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    import gc

    sizes: list[dict] = []

    def save_json(scan: dict | None = None, agree: dict | None = None) -> None:
        data = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": f"{os.cpu_count()} cores, {os.uname().machine}", "sizes": sizes, "scan": scan,
                "agreement": agree}
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(data, indent=2))

    for s in args.sizes.split(","):
        r = bench_size(float(s), getattr(torch, args.dtype), args.rounds, work,
                       Path(f"{args.json_out}.{s}gib.partial") if args.json_out else None, args.saves_only)
        r["ratio_to_best_peer"] = {k: ratio_to_best_peer(r, k) for k in r["all"]
                                   if k == OURS or k.startswith("slurmresume save, writer=")}
        sizes.append(r)
        report([r], None, None)  # each size as soon as it is measured: a later size that fails or is
        save_json()  # stopped (a 4 GiB run out of memory or time) does not take the earlier ones with it
        sys.stdout.flush()
        gc.collect()
    scan = None if args.quick else bench_scan(work)
    agree = None if args.quick else bench_agreement()
    report([], scan, agree)
    save_json(scan, agree)
    print(json.dumps({"sizes": [{"gib": r["gib"], "seconds": r["seconds"], "ratio_to_best_peer": {
        k: {x: v for x, v in q.items() if x != "ratios"} for k, q in r["ratio_to_best_peer"].items()}}
        for r in sizes]}))
    shutil.rmtree(work, ignore_errors=True) if not args.dir else None


if __name__ == "__main__":
    main()

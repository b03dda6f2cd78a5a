"""What a committed checkpoint holds (`slurmresume inspect`), computed as plain data.

Reads only, from one process, and only committed checkpoints (an incomplete or corrupt
directory is refused with the command that explains it). Without `tensors=True` only the
manifest and each shard's header are read. With it, every tensor's values are streamed
through one reused buffer of `STATS_CHUNK` bytes, so memory stays bounded whatever the
checkpoint's size. (Not `safe_open(...).get_slice` nor `np.memmap`: both map the file, and
every page touched then counts in the process's resident memory until the map is dropped.)

`inspect_checkpoint(...).to_json()` is what `slurmresume inspect --json` prints. Schema
"slurmresume.tools.inspect/1" (keys are stable; new keys may be added):

    schema, step, path   "slurmresume.tools.inspect/1", the step (int), the step directory (str)
    world_size, bytes    ranks that wrote it, total shard bytes
    created, created_iso epoch seconds, UTC ISO 8601
    metrics, meta        what `save(..., metrics=, meta=)` recorded
    state                [{key, kind: "stateful"|"value", tensors: int, bytes: int, ranks: [int]}]:
                         the top-level keys of the saved state, from the shards' skeletons
    library              keys the library stored beside the state (e.g. "rng")
    tensors              sorted by name, then rank: [{name, rank, dtype, shape, numel, bytes,
                         stats: {min, max, mean, nan_count, inf_count} | null}]; min, max
                         and mean are over finite values (null when there are none)
    stats_computed       whether tensor values were read (--tensors)
    nan_count, inf_count totals over every tensor (null unless stats_computed)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from ..checkpoint.jsonenc import loads
from ..checkpoint.layout import parse_step_dir, step_dir_name
from ..checkpoint.shard import ITEMSIZE, SKELETON_KEY
from ..checkpoint.shardread import open_checked, read_header
from ..checkpoint.state import RESERVED
from ..checkpoint.store import UNREADABLE, inspect_dir
from ..errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    UnreadableCheckpointError,
)
from ..storage import DirRoot

__all__ = ["SCHEMA", "CheckpointReport", "TensorInfo", "TensorStats", "StateKey", "needs_root", "locate",
           "inspect_checkpoint", "tensor_stats"]

SCHEMA = "slurmresume.tools.inspect/1"
STATS_CHUNK = 4 << 20  # bytes per read; about twice this is in use at once

_NUMPY = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
          "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16,
          "U8": np.uint8, "BOOL": np.uint8}
_WIDENED = {"F16", "BF16", "F8_E4M3", "F8_E5M2"}


@dataclass
class TensorStats:
    min: float | int | None
    max: float | int | None
    mean: float | None
    nan_count: int
    inf_count: int


@dataclass
class TensorInfo:
    name: str
    rank: int
    dtype: str
    shape: list[int]
    numel: int
    bytes: int
    stats: TensorStats | None = None


@dataclass
class StateKey:
    key: str
    kind: str
    tensors: int
    bytes: int
    ranks: list[int] = field(default_factory=list)


@dataclass
class CheckpointReport:
    step: int
    path: str
    world_size: int
    bytes: int
    created: float
    created_iso: str | None
    metrics: Any
    meta: Any
    state: list[StateKey]
    library: list[str]
    tensors: list[TensorInfo]
    stats_computed: bool = False

    def count(self, what: str) -> int | None:
        """Total `nan_count` or `inf_count` over every tensor (None without stats)."""
        if not self.stats_computed:
            return None
        return sum(int(getattr(t.stats, what)) for t in self.tensors if t.stats is not None)

    def to_json(self) -> dict[str, Any]:
        from .status import plain_json

        return cast(dict[str, Any], plain_json({"schema": SCHEMA, **asdict(self), "nan_count": self.count("nan_count"),
                                                "inf_count": self.count("inf_count")}))


# -- which checkpoint -------------------------------------------------------------------------

def needs_root(target: str) -> bool:
    """Whether `target` names a checkpoint relative to a root (a step number or "latest")."""
    return target == "latest" or re.fullmatch(r"\d+", target) is not None


def locate(target: str, root: Path | None) -> tuple[int, Path]:
    """(step, step directory) for STEP_OR_PATH: a step number under `root`, "latest" (the
    newest complete checkpoint under `root`), or a path to a step directory."""
    if needs_root(target):
        if root is None:
            raise ConfigError(f"{target!r} is relative to a checkpoint root: pass --ckpt-dir DIR")
        if target == "latest":
            info = DirRoot(root).latest()
            if info is None:
                raise NoCheckpointError(f"no complete checkpoint under {root} to inspect")
            return info.step, info.path
        return int(target), root / step_dir_name(int(target))
    path = Path(target).expanduser().absolute()
    if not path.exists():
        raise ConfigError(f"{target!r} is not a step number, 'latest', or an existing step directory")
    step = parse_step_dir(path.name)
    if step is None or not path.is_dir():
        raise ConfigError(f"{path} is not a step directory (named like {step_dir_name(1200)}): "
                          "pass the step's folder, a step number, or latest")
    return step, path


# -- the report -------------------------------------------------------------------------------

def inspect_checkpoint(step: int, path: Path, *, tensors: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> CheckpointReport:
    """What committed checkpoint `path` (of `step`) holds; `tensors` also reads every value
    for min/max/mean/NaN/Inf. Raises NoCheckpointError for a missing or incomplete directory,
    CorruptCheckpointError when it fails its checks (sizes, headers, manifest index).
    `progress(done, total)` is called after each tensor's statistics (`tensors` only)."""
    info = inspect_dir(step, path)
    root = path.parent
    if not path.exists():
        raise NoCheckpointError(f"no step {step} under {root}: `slurmresume status --ckpt-dir {root}` lists them")
    if not info.has_marker and info.problem and info.problem.startswith(UNREADABLE):
        raise CheckpointError(f"{path} is {info.problem}")
    if not info.has_marker:
        raise NoCheckpointError(f"{path} is incomplete (no commit marker): only committed checkpoints can be "
                                f"inspected; `slurmresume latest --ckpt-dir {root}` names the newest one")
    if info.unreadable:
        raise UnreadableCheckpointError(info.problem or f"checkpoint {path} is unreadable by this version")
    if not info.complete or info.manifest is None:
        raise CorruptCheckpointError(f"checkpoint {path} is corrupt: {info.problem}; "
                                     f"`slurmresume verify {step} --ckpt-dir {root}` checks it")
    m = info.manifest
    headers = [read_header(path, s["file"], s["bytes"]) for s in m.shards]
    rows = _tensor_rows(path, m.tensors, [h for h, _ in headers])
    state, library = _state_keys(path, m.shards, [h for h, _ in headers], rows)
    if tensors:
        by_key = {(r.rank, r.name): r for r in rows}
        done = 0
        for rank, (shard, (header, start)) in enumerate(zip(m.shards, headers, strict=True)):
            for name, stats in tensor_stats(path, shard["file"], shard["bytes"], header, start):
                done += 1
                if progress is not None:
                    progress(done, len(rows))
                if (rank, name) not in by_key:
                    raise CorruptCheckpointError(f"checkpoint {path}: {shard['file']} holds tensor {name!r} that the "
                                                 "manifest's tensor index does not list")
                by_key[(rank, name)].stats = stats
    return CheckpointReport(step, str(path), m.world_size, m.total_bytes, m.created, m.raw.get("created_iso"),
                            m.metrics, m.meta, state, library, rows, stats_computed=tensors)


def _tensor_rows(path: Path, index: list[Any], headers: list[dict[str, Any]]) -> list[TensorInfo]:
    """Rows from the manifest's tensor index, each checked against its shard's header."""
    rows = []
    for entry in index:
        try:
            name, rank, dtype, shape = entry["name"], entry["rank"], entry["dtype"], list(entry["shape"])
            if not (isinstance(rank, int) and 0 <= rank < len(headers)) or name == "__metadata__":
                raise KeyError(name)
            in_header = headers[rank][name]
        except (KeyError, TypeError):
            raise CorruptCheckpointError(f"manifest {path}: tensor index entry {str(entry)[:200]} "
                                         "names no tensor of its shard") from None
        if not isinstance(name, str) or (in_header.get("dtype"), in_header.get("shape")) != (dtype, shape):
            raise CorruptCheckpointError(f"manifest {path}: tensor {name!r} of rank {rank} disagrees with "
                                         "its shard header: `slurmresume verify` checks the files")
        numel = math.prod(shape)
        rows.append(TensorInfo(name, rank, dtype, shape, numel, numel * ITEMSIZE[dtype]))
    rows.sort(key=lambda r: (r.name, r.rank))
    return rows


def _tensor_refs(value: Any, out: set[str]) -> set[str]:
    if isinstance(value, list):
        for v in value:
            _tensor_refs(v, out)
    elif isinstance(value, dict):
        if len(value) == 1 and isinstance(value.get("__tensor__"), str):
            out.add(value["__tensor__"])
        else:
            for v in value.values():
                _tensor_refs(v, out)
    return out


def _state_keys(path: Path, shards: Sequence[dict[str, Any]], headers: list[dict[str, Any]],
                rows: list[TensorInfo]) -> tuple[list[StateKey], list[str]]:
    """Top-level state keys (union over ranks) with their tensors, from each shard's skeleton."""
    nbytes = {(r.rank, r.name): r.bytes for r in rows}
    keys: dict[str, StateKey] = {}
    library: set[str] = set()
    for rank, (shard, header) in enumerate(zip(shards, headers, strict=True)):
        meta = header.get("__metadata__") or {}
        raw = meta.get(SKELETON_KEY) if isinstance(meta, dict) else None
        skeleton = loads(raw, f"skeleton of {path / shard['file']}") if isinstance(raw, str) else None
        if not isinstance(skeleton, dict) or not isinstance(skeleton.get("entries"), dict):
            raise CorruptCheckpointError(f"shard {path / shard['file']} has no valid slurmresume skeleton")
        for key, entry in skeleton["entries"].items():
            kind = entry.get("kind") if isinstance(entry, dict) else None
            refs = _tensor_refs(entry.get("value") if isinstance(entry, dict) else None, set())
            row = keys.setdefault(key, StateKey(key, str(kind), 0, 0))
            row.tensors += len(refs)
            row.bytes += sum(nbytes.get((rank, n), 0) for n in refs)
            row.ranks.append(rank)
        if isinstance(skeleton.get("library"), dict):
            library.update(skeleton["library"])
    return list(keys.values()), sorted(library - {RESERVED})


# -- tensor values, streamed --------------------------------------------------------------------

class _Accumulator:
    """min/max/sum over finite values plus NaN and Inf counts, fed one chunk at a time."""

    def __init__(self, integer: bool) -> None:
        self.integer = integer
        self.lo: Any = None
        self.hi: Any = None
        self.total = 0.0
        self.count = self.nan = self.inf = 0

    def add(self, x: np.ndarray) -> None:
        if x.size == 0:
            return
        total = float(x.sum(dtype=np.float64))
        if self.integer or math.isfinite(total):
            lo, hi, n = x.min().item(), x.max().item(), int(x.size)
        else:  # a NaN or Inf is here (or the sum overflowed): reduce over the finite values only
            finite = np.isfinite(x)
            n = int(np.count_nonzero(finite))
            nan = int(np.count_nonzero(np.isnan(x)))
            self.nan, self.inf = self.nan + nan, self.inf + int(x.size) - n - nan
            if n == 0:
                return
            total = float(x.sum(dtype=np.float64, where=finite))
            lo = x.min(where=finite, initial=np.inf).item()
            hi = x.max(where=finite, initial=-np.inf).item()
        self.lo = lo if self.lo is None else min(self.lo, lo)
        self.hi = hi if self.hi is None else max(self.hi, hi)
        self.total += total
        self.count += n

    def result(self) -> TensorStats:
        mean = self.total / self.count if self.count else None
        return TensorStats(self.lo, self.hi, mean, self.nan, self.inf)


def _decode(buf: memoryview, dtype: str, scratch: np.ndarray) -> np.ndarray:
    """The chunk's values as a NumPy array; half floats widened to float32 into `scratch`
    (float32), 8-bit floats through torch."""
    if dtype == "BF16":  # bfloat16 is the top half of a float32: exact
        wide = scratch[: len(buf) // 2].view(np.uint32)
        np.copyto(wide, np.frombuffer(buf, np.uint16))
        wide <<= 16
        return wide.view(np.float32)
    if dtype == "F16":
        wide = scratch[: len(buf) // 2]
        np.copyto(wide, np.frombuffer(buf, np.float16))
        return wide
    if dtype in ("F8_E4M3", "F8_E5M2"):
        import torch

        kind = torch.float8_e4m3fn if dtype == "F8_E4M3" else torch.float8_e5m2
        return torch.frombuffer(buf, dtype=kind).float().numpy()
    return np.frombuffer(buf, _NUMPY[dtype])


def tensor_stats(path: Path, file: str, expected_bytes: int, header: dict[str, Any], data_start: int,
                 chunk: int = STATS_CHUNK) -> list[tuple[str, TensorStats]]:
    """Stats of every tensor of one shard (header as `shardread.read_header` validated it), read
    in `chunk`-byte pieces through one reused buffer: memory is O(chunk), not O(shard)."""
    fd = open_checked(path, file, expected_bytes)
    if hasattr(os, "posix_fadvise"):  # one sequential pass: ask for a larger read-ahead
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buf = bytearray(chunk)
    scratch = np.empty(chunk // 4, np.float32)  # touched only by half-float tensors
    out = []
    try:
        for name, spec in sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                                 key=lambda kv: kv[1]["data_offsets"][0]):
            begin, stop = spec["data_offsets"]
            dtype, size = spec["dtype"], ITEMSIZE[spec["dtype"]]
            # widened to float32, a chunk of half or 8-bit floats is read smaller: same memory
            step = chunk // 4 * size if dtype in _WIDENED else chunk - chunk % size
            acc = _Accumulator(integer=dtype not in _WIDENED | {"F32", "F64"})
            for off in range(begin, stop, step):
                n = min(step, stop - off)
                view = memoryview(buf)[:n]
                got = os.preadv(fd, [view], data_start + off)
                if got != n:
                    raise CorruptCheckpointError(f"shard {path / file} ended early inside tensor {name!r}")
                acc.add(_decode(view, dtype, scratch))
            out.append((name, acc.result()))
    except OSError as exc:
        raise CorruptCheckpointError(f"cannot read shard {path / file}: {exc}") from exc
    finally:
        os.close(fd)
    return out

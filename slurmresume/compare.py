"""Compare two committed checkpoints tensor by tensor and value by value (the drill's verdict)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint.jsonenc import loads
from .checkpoint.manifest import read_manifest
from .checkpoint.shard import SKELETON_KEY, load_tensors
from .checkpoint.state import RESERVED as LIBRARY  # key of library-owned entries (RNG)

HINTS = {
    "scheduler": "did you save the LR scheduler?",
    "sampler": "did you save the sampler / data position?",
    "optimizer": "did you save the optimizer and the scheduler?",
    "model": "is the data order or the dropout RNG reproduced (seeded sampler, DataLoader generator)?",
    "__slurmresume__": "the RNG states differ: seed random, numpy and torch in the script, and make "
                       "sure nothing draws from the global RNG differently after a resume (e.g. a "
                       "DataLoader without generator=); --ignore __slurmresume__ skips this check",
}


@dataclass
class Difference:
    rank: int
    key: str  # a tensor name like "model/blocks.0.weight" or a state path like "scheduler"
    detail: str

    @property
    def hint(self) -> str:
        return HINTS.get(self.key.split("/", 1)[0], "")

    def __str__(self) -> str:
        top = self.key.split("/", 1)[0]
        text = f"rank {self.rank}: {top} state differs after resume at '{self.key}' ({self.detail})"
        return f"{text}: {self.hint}" if self.hint else text


def _load(step_dir: Path, rank: int, shard: dict) -> tuple[dict, dict]:
    tensors, meta, _ = load_tensors(step_dir, shard["file"], shard["bytes"])
    return tensors, loads(meta.get(SKELETON_KEY, "{}"), "skeleton")


def compare_checkpoints(a: Path, b: Path, ignore_keys: tuple[str, ...] = ()) -> list[Difference]:
    """Every difference between two committed step directories (empty: bitwise equal).
    `ignore_keys` lists state keys that may differ (e.g. wall-clock metrics)."""
    ma, mb = read_manifest(Path(a)), read_manifest(Path(b))
    if ma.world_size != mb.world_size:
        return [Difference(0, "world_size", f"{ma.world_size} vs {mb.world_size} ranks")]
    diffs: list[Difference] = []
    for rank, (sa, sb) in enumerate(zip(ma.shards, mb.shards, strict=True)):
        ta, ka = _load(Path(a), rank, sa)
        tb, kb = _load(Path(b), rank, sb)
        for name in sorted(set(ta) | set(tb)):
            if name.split("/", 1)[0] in ignore_keys:
                continue
            if name not in ta or name not in tb:
                diffs.append(Difference(rank, name, "present in only one checkpoint"))
            elif ta[name].dtype != tb[name].dtype or ta[name].shape != tb[name].shape:
                diffs.append(Difference(rank, name, f"{ta[name].dtype}{list(ta[name].shape)} vs "
                                                    f"{tb[name].dtype}{list(tb[name].shape)}"))
            elif not _bitwise_equal(ta[name], tb[name]):
                diffs.append(Difference(rank, name, _max_delta(ta[name], tb[name])))
        diffs.extend(_compare_values(rank, ka.get("entries", {}), kb.get("entries", {}), ignore_keys))
        # library-owned state (Python / NumPy RNG) lives in the skeleton, not only in tensors
        diffs.extend(_compare_values(rank, {LIBRARY: ka.get("library")}, {LIBRARY: kb.get("library")},
                                     ignore_keys))
    return sorted(diffs, key=lambda d: (_order(d.key), d.rank, d.key))


def _order(key: str) -> int:
    return ["scheduler", "sampler", "optimizer", "model"].index(key.split("/")[0]) \
        if key.split("/")[0] in ("scheduler", "sampler", "optimizer", "model") else 4


def _bitwise_equal(x: Any, y: Any) -> bool:
    import torch

    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) if x.numel() else True


def _max_delta(x: Any, y: Any) -> str:
    if x.is_floating_point():
        return f"max |delta| {float((x.double() - y.double()).abs().max()):.3g}"
    return f"{int((x != y).sum())} elements differ"


def _compare_values(rank: int, ea: dict, eb: dict, ignore: tuple[str, ...]) -> list[Difference]:
    out = []
    for key in sorted(set(ea) | set(eb)):
        if key in ignore:
            continue
        if key not in ea or key not in eb:
            out.append(Difference(rank, key, "state key saved by only one run"))
        elif _strip_tensors(ea[key]) != _strip_tensors(eb[key]):
            out.append(Difference(rank, key, "non-tensor values differ"))
    return out


def _strip_tensors(v: Any) -> Any:
    """Tensor names are compared through the tensors themselves; here only the structure."""
    if isinstance(v, dict):
        if set(v) == {"__tensor__"}:
            return "<tensor>"
        if set(v) == {"__float__"} and v["__float__"] == "nan":
            return "nan"
        return {k: _strip_tensors(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_strip_tensors(x) for x in v]
    return v

"""Compare two committed checkpoints tensor by tensor and value by value (the drill's verdict),
and rank what differs by root cause.

Causes come before what they feed: RNG streams (each of Python, NumPy, torch CPU, CUDA on its
own), then plain values and user objects (scheduler, sampler, generators, anything with a
state_dict that is neither a model nor an optimizer), then optimizers, then models. What kind a
stateful entry is comes from the shape of its saved state (an optimizer's has "state" and
"param_groups"; a module's is a flat mapping of tensors), not from its key.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.jsonenc import loads
from ..checkpoint.manifest import read_manifest
from ..checkpoint.shard import SKELETON_KEY
from ..checkpoint.shardread import load_tensors
from ..checkpoint.state import RESERVED as LIBRARY  # key of library-owned entries (RNG)

ADAPT = "see README §Adapt your script"
# cause -> rank: what is listed first is what the others follow from
# ("hyper": an optimizer's non-tensor state, its param_groups' lr etc., which everything after
# it follows; "value": plain values, often a consequence such as the last loss, so after objects)
CAUSES = {"rng": 0, "hyper": 1, "object": 2, "value": 3, "optimizer": 4, "model": 5, "other": 6}

# a framework's own timing fields, in the log history its saved state carries (HF Trainer's
# trainer_state.log_history: eval_runtime, train_samples_per_second, ...): never compared
LOG_HISTORIES = frozenset({"log_history"})
WALL_CLOCK = ("*_runtime", "*_per_second")

HINTS = {
    "scheduler": "did you save the LR scheduler?",
    "sampler": "did you save the sampler / data position?",
}
CAUSE_HINTS = {
    "rng": "this RNG stream is drawn differently after a resume: worker-side randomness (DataLoader "
           "workers are seeded when an iterator is created: use SeededDataset), a script-owned generator "
           "that is not in state, a draw outside the saved state, or restore(..., restore_rng=False); "
           f"{ADAPT}",
    "value": "a plain value differs: keep every value carried between steps (prefetched batch, hidden "
             "state, best metric) in state and read it back from there after restore(); a result of the "
             "step (the last loss) follows from what fed it: worker-side augmentation (SeededDataset) or a "
             f"script-owned generator; {ADAPT}",
    "object": f"its state_dict() does not capture everything it uses; {ADAPT}",
    "hyper": "the optimizer's hyperparameters (param_groups: lr, ...) differ: did you save the LR "
             f"scheduler, and restore before building anything that changes them? {ADAPT}",
    "optimizer": "did you save the LR scheduler? Otherwise the data order or randomness is not in the "
                 "state: a script-owned torch.Generator (state[\"gen\"] = gen), the sampler's position "
                 f"(sampler.advance), worker-side draws (SeededDataset); {ADAPT}",
    "model": "is the data order or the randomness reproduced (a seeded sampler advanced after each batch, a "
             "DataLoader generator, a script-owned torch.Generator in state, worker-side augmentation: "
             f"SeededDataset)? With DDP on 3+ ranks: the gradient bucket layout; {ADAPT}",
    "other": "",
}
UNSEEDED = "never seeded: it differed between the two runs already at the first checkpoint; seed it if your " \
           "script uses it (--ignore {key} to skip it)"
FOLLOWS = "follows from the difference(s) listed before it"
DDP_DRIFT = ("only what the training step computes differs, on {world} ranks: with DDP, its gradient bucket "
             "layout (rebuilt after a process's first backward; with 3+ ranks the all-reduce rounds by it). The "
             "Checkpointer records it when the model or the DDP wrapper is in state (a framework's own wrapper: "
             "ckpt.track_ddp(key, wrapper) before its first forward); otherwise add "
             "state[\"ddp_buckets\"] = slurmresume.DDPBuckets(ddp_model), "
             "and check it is not DDPBuckets(..., enabled=False). Otherwise: {rest}")
NOT_REPRODUCIBLE = "differed already at the first checkpoint, before any preemption: the script is not " \
                   "reproducible run to run (seed everything it draws from at start-up)"


@dataclass
class Difference:
    rank: int
    key: str  # a tensor name like "model/blocks.0.weight", a state key, or an RNG stream "rng.numpy"
    detail: str
    cause: str = "other"  # see CAUSES
    note: str = ""  # set by the drill: why this one is (or is not) a culprit; overrides the hint

    @property
    def top(self) -> str:
        """The top-level state key (or the RNG stream) this difference belongs to."""
        return self.key if self.cause == "rng" else self.key.split("/", 1)[0]

    @property
    def hint(self) -> str:
        if self.note:
            return self.note
        return HINTS.get(self.top, "") if self.cause == "object" and self.top in HINTS else CAUSE_HINTS[self.cause]

    def __str__(self) -> str:
        what = f"RNG stream {self.key}" if self.cause == "rng" else f"{self.top} state"
        text = f"rank {self.rank}: {what} differs at '{self.key}' ({self.detail})"
        return f"{text}: {self.hint}" if self.hint else text


def rng_stream(name: str) -> str | None:
    """'__slurmresume__/rng/torch_cpu' -> 'rng.torch_cpu' ('rng.torch_cuda' for each device)."""
    parts = name.split("/")
    if parts[0] != LIBRARY:
        return None
    if len(parts) >= 3 and parts[1] == "rng":
        return f"rng.{parts[2]}"
    return "lib." + "/".join(parts[1:2])


def ignored(key: str, ignore: tuple[str, ...]) -> bool:
    """`--ignore` matching: a top-level state key, one RNG stream ("rng.numpy"), every RNG
    stream ("rng"), or every library entry ("__slurmresume__")."""
    stream = rng_stream(key) if key.startswith(LIBRARY) else (key if key.startswith(("rng.", "lib.")) else None)
    if stream is not None:
        return bool({stream, stream.split(".", 1)[0], LIBRARY} & set(ignore))
    return key.split("/", 1)[0] in ignore


def _kinds(skeleton: dict[str, Any]) -> dict[str, str]:
    """Top-level state key -> cause class, from the saved skeleton's shape."""
    out: dict[str, str] = {}
    for key, entry in (skeleton.get("entries") or {}).items():
        value = entry.get("value") if isinstance(entry, dict) else None
        if not isinstance(entry, dict) or entry.get("kind") != "stateful":
            out[key] = "value"
        elif isinstance(value, dict) and {"state", "param_groups"} <= set(value):
            out[key] = "optimizer"
        elif isinstance(value, dict) and value and all(isinstance(v, dict) and set(v) == {"__tensor__"}
                                                        for k, v in value.items() if k != "_extra_state"):
            out[key] = "model"
        else:
            out[key] = "object"
    return out


def _load(step_dir: Path, rank: int, shard: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    tensors, meta, _ = load_tensors(step_dir, shard["file"], shard["bytes"])
    return tensors, loads(meta.get(SKELETON_KEY, "{}"), "skeleton")


def compare_checkpoints(a: Path, b: Path, ignore_keys: tuple[str, ...] = ()) -> list[Difference]:
    """Every difference between two committed step directories (empty: bitwise equal), causes
    first (see CAUSES). `ignore_keys` lists what may differ: state keys (e.g. wall-clock
    metrics), RNG streams ("rng.numpy"), all RNG ("rng")."""
    ma, mb = read_manifest(Path(a)), read_manifest(Path(b))
    if ma.world_size != mb.world_size:
        return [Difference(0, "world_size", f"{ma.world_size} vs {mb.world_size} ranks")]
    diffs: list[Difference] = []
    for rank, (sa, sb) in enumerate(zip(ma.shards, mb.shards, strict=True)):
        ta, ka = _load(Path(a), rank, sa)
        tb, kb = _load(Path(b), rank, sb)
        kinds = {**_kinds(kb), **_kinds(ka)}
        for name in sorted(set(ta) | set(tb)):
            if ignored(name, ignore_keys):
                continue
            key = rng_stream(name) or name
            if name not in ta or name not in tb:
                diffs.append(Difference(rank, key, "present in only one checkpoint", _cause(name, kinds)))
            elif ta[name].dtype != tb[name].dtype or ta[name].shape != tb[name].shape:
                diffs.append(Difference(rank, key, f"{ta[name].dtype}{list(ta[name].shape)} vs "
                                                   f"{tb[name].dtype}{list(tb[name].shape)}", _cause(name, kinds)))
            elif not _bitwise_equal(ta[name], tb[name]):
                diffs.append(Difference(rank, key, _max_delta(ta[name], tb[name]), _cause(name, kinds)))
        for d in _compare_values(rank, ka.get("entries", {}), kb.get("entries", {}), ignore_keys):
            d.cause = kinds.get(d.key, "other")
            if d.cause == "optimizer":  # only the non-tensor part is compared here
                d.cause = "hyper"
            diffs.append(d)
        # library-owned state (Python / NumPy RNG) lives in the skeleton, one comparison per stream
        la, lb = _library_values(ka), _library_values(kb)
        for d in _compare_values(rank, la, lb, ()):
            if not ignored(d.key, ignore_keys):
                d.cause = "rng"
                diffs.append(d)
    return _merge_streams(sorted(diffs, key=lambda d: (CAUSES[d.cause], d.rank, d.key)))


def _cause(name: str, kinds: dict[str, str]) -> str:
    return "rng" if rng_stream(name) else kinds.get(name.split("/", 1)[0], "other")


def _library_values(skeleton: dict[str, Any]) -> dict[str, Any]:
    lib = skeleton.get("library")
    if not isinstance(lib, dict):
        return {}
    out: dict[str, Any] = {}
    for k, v in lib.items():
        if k == "rng" and isinstance(v, dict):
            out.update({f"rng.{s}": x for s, x in v.items()})
        else:
            out[f"lib.{k}"] = v
    return out


def _merge_streams(diffs: list[Difference]) -> list[Difference]:
    """One line per (rank, RNG stream): its tensor and its JSON parts are the same stream."""
    seen: set[tuple[int, str]] = set()
    out = []
    for d in diffs:
        if d.cause == "rng":
            if (d.rank, d.key) in seen:
                continue
            seen.add((d.rank, d.key))
        out.append(d)
    return out


def explain(diffs: list[Difference], unseeded: set[str] | frozenset[str] = frozenset(),
            first: set[str] | frozenset[str] = frozenset(), world: int = 1) -> None:
    """Set each difference's note: an RNG stream that differed already at the first checkpoint is
    "never seeded" (not a resume failure); any other key that differed there is run-to-run
    non-determinism; an optimizer or model difference below a cause "follows from" it. On 3+
    ranks, when only what the step computes differs (values, optimizer, model), the first one
    names DDP's bucket layout first."""
    seen: set[str] = set()
    causes = {d.cause for d in diffs if not (d.cause == "rng" and d.key in unseeded)}
    if world >= 3 and causes and causes <= {"value", "optimizer", "model"}:
        lead = next(d for d in diffs if d.cause in causes)
        if lead.top not in first:
            lead.note = DDP_DRIFT.format(world=world, rest=lead.hint)
    for d in diffs:
        if d.cause == "rng" and d.key in unseeded:
            d.note = UNSEEDED.format(key=d.key)
            continue
        if d.top in first:
            d.note = NOT_REPRODUCIBLE
        elif d.note:
            pass
        elif (d.cause == "value" and seen & {"rng", "hyper", "object"}) or (
                d.cause == "optimizer" and seen & {"rng", "hyper", "value", "object"}) or (
                d.cause == "model" and seen & {"rng", "hyper", "value", "object", "optimizer"}):
            d.note = FOLLOWS
        seen.add(d.cause)


def culprits(diffs: list[Difference]) -> list[Difference]:
    """The differences that fail the drill: all but the never-seeded RNG streams."""
    return [d for d in diffs if not d.note.startswith("never seeded")]


def _bitwise_equal(x: Any, y: Any) -> bool:
    import torch

    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)) if x.numel() else True


def _max_delta(x: Any, y: Any) -> str:
    if x.is_floating_point():
        return f"max |delta| {float((x.double() - y.double()).abs().max()):.3g}"
    return f"{int((x != y).sum())} elements differ"


def _compare_values(rank: int, ea: dict[str, Any], eb: dict[str, Any], ignore: tuple[str, ...]) -> list[Difference]:
    out = []
    for key in sorted(set(ea) | set(eb)):
        if key in ignore:
            continue
        if key not in ea or key not in eb:
            out.append(Difference(rank, key, "state key saved by only one run"))
        else:
            a, b = _strip_tensors(ea[key]), _strip_tensors(eb[key])
            if a != b:
                where = first_difference(a, b)
                out.append(Difference(rank, key, "non-tensor values differ" + (f" at {where}" if where else "")))
    return out


def first_difference(a: Any, b: Any, path: str = "") -> str:
    """Where two decoded skeleton values first differ, as 'a/b/0: 3 vs 2' (inside a framework's
    state: which callback, loop counter or log entry), skipping the skeleton's wrappers."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k in ("value", "kind") and not path:  # the stateful entry's own wrapper
                if a.get(k) != b.get(k):
                    return first_difference(a.get(k), b.get(k), path)
                continue
            sub = f"{path}/{k}" if path else str(k)
            if k not in a or k not in b:
                return f"{sub}: only in one run"
            if a[k] != b[k]:
                return first_difference(a[k], b[k], sub)
        return ""
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            if x != y:
                return first_difference(x, y, f"{path}/{i}" if path else str(i))
        return ""
    return f"{path or '<value>'}: {_brief(a)} vs {_brief(b)}"


def _brief(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 30 else text[:27] + "..."


def _strip_tensors(v: Any, wall_clock: bool = False) -> Any:
    """Tensor names are compared through the tensors themselves; here only the structure.
    `wall_clock`: inside a framework's log history, where timing keys are dropped (WALL_CLOCK)."""
    if isinstance(v, dict):
        if set(v) == {"__tensor__"}:
            return "<tensor>"
        if set(v) == {"__float__"} and v["__float__"] == "nan":
            return "nan"
        return {k: _strip_tensors(x, k in LOG_HISTORIES) for k, x in v.items()
                if not (wall_clock and any(fnmatch.fnmatchcase(str(k), p) for p in WALL_CLOCK))}
    if isinstance(v, list):
        return [_strip_tensors(x, wall_clock) for x in v]
    return v

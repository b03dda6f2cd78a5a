"""One rank's small state at one step boundary, as the failure-time save needs it (train/failsave.py):
captured at each `ckpt.step()`, published to a node-local file that outlives the rank, and turned
back into the rank's skeleton and per-rank tensors by whichever survivor writes the save.

What a snapshot holds, and why it is cheap enough for every step (issue 47: <= 1% of a step):
  - the skeleton entries of every state key that can change per rank and per step (optimizer
    hyper-parameters, scheduler, sampler, plain values), encoded with a path-named tensor hook
    (the save's `TensorTable` naming, without its per-tensor storage lookups: `Layout.learn`
    checks once that both name every tensor alike, else each step takes the save's own path);
  - NOT the entries whose only leaves are replicated tensors (a DDP module): the writer has
    those in memory, bit for bit, and encodes them itself;
  - the RNG states of every generator the save covers (`rng.capture`), as raw bytes, re-encoded
    by the writer exactly as a save would (`checkpoint.state.flatten` of the library entry);
  - the rank's tensors that are not replicated, when small and on the CPU (else named missing);
  - metrics and meta (rank 0's go into the manifest).
The file: 24 bytes (the JSON's length, the raw bytes' length, xxh3 of both), the JSON, then the raw
bytes (RNG states, tensors) it points into, copied in one go into one of two slots (step % 2;
`snappub.FileSink`: a mapped file, zeros or an older record after the record, `cut`): a rank
killed mid-write leaves a slot that fails its check, and the other slot still holds the step before.

A capture is two halves: `grab` on the training thread takes what must be taken at that moment
(each entry's JSON text, by `_fast_text`, which gives `dumps` of `jsonenc.encode`'s result; copies
of the per-rank tensors; the RNG states as bytes), and `record` (its bytes) may run later on the
publisher thread (train/snappub.py). No piece is hashed on the way: the guard compares a tail with
its boundary by their bytes (`moved`), and a reader derives each piece's digest from the record
(`digests`) when a failure save plans; each step of a capture on a cache the step's compute
evicted costs microseconds, so a capture takes as few as it can (docs/benchmarks.md, issue 47).
"""

from __future__ import annotations

import array
import itertools
import json
import operator
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..checkpoint.jsonenc import TAGS, dumps, encode
from ..checkpoint.state import as_stateful, flatten, is_stateful
from . import rng
from .survivors import ReplicaDims, replica_dims

HEADER = struct.Struct("<QQQ")
PUBLISH_MAX_BYTES = 1 << 20  # a rank's non-replicated tensors published per step, at most


@dataclass
class Layout:
    """Learned at the first step (every rank alike): which state keys hold replicated tensors
    only (`static`), which top-level parts of the others do (`parts`: an optimizer's "state"),
    whether the cheap path encodes every other part exactly as the save does (`cheap`), and which
    ranks hold the same piece of each DTensor (`replicas`: HSDP's replica groups, from the
    placements: `survivors.replica_dims`)."""

    replicated: set[str]
    static: frozenset[str]
    parts: dict[str, frozenset[str]]
    cheap: bool
    replicas: dict[str, ReplicaDims] = field(default_factory=dict)
    # the training thread's own: an optimizer entry's JSON kept between captures (`_OptimizerText`)
    texts: dict[str, _OptimizerText] = field(default_factory=dict)

    @classmethod
    def learn(cls, state: Mapping[str, Any], replicated: set[str], world: int = 1) -> Layout:
        skeleton, _ = flatten(state, {})
        entries = skeleton["entries"]
        static, parts = set(), {}
        for key, entry in entries.items():
            value = entry["value"]
            if _replicas_only(value, replicated):
                static.add(key)
            elif entry["kind"] == "stateful" and isinstance(value, dict) and all(not k.startswith("__") for k in value):
                parts[key] = frozenset(k for k, v in value.items() if _replicas_only(v, replicated))
        layout = cls(replicated, frozenset(static), parts, False, replica_dims(skeleton.get("dtensors") or {}, world))
        layout.cheap = (not skeleton.get("devices") and not skeleton.get("dtensors")
                        and _merge(entries, {k: json.loads(t) for k, t in _cheap_texts(state, layout, {}).items()})
                        == entries)
        if layout.cheap:
            layout.texts = {key: _OptimizerText() for key in parts
                            if parts[key] == {"state"} and _OptimizerText.applies(state[key])}
        return layout


@dataclass
class Captured:
    """One rank's small state at one moment (`Grab`), with a digest per piece ("entry:<key>",
    "rng", "tensor:<name>"): the digests a reader derives from the published record (`digests`),
    so that a capture is compared piece by piece as `survivors.plan` compares published records.
    Off the training thread's path (tests, `capture`): the guard compares grabs (`moved`)."""

    grab: Grab

    @property
    def texts(self) -> dict[str, str]:
        return self.grab.entries

    @property
    def digests(self) -> dict[str, str]:
        snap = read_bytes(b"".join(record(self.grab)))
        assert snap is not None  # just encoded
        return digests(snap)

    def encode(self, *, tail_of: int | None = None, tail_changed: list[str] | None = None) -> list[bytes]:
        return record(self.grab, tail_of=tail_of, tail_changed=tail_changed)


def capture(step: int, state: Mapping[str, Any], layout: Layout, ddp_layout: dict[str, str] | None,
            metrics: Any, meta: Any) -> list[bytes]:
    """This rank's snapshot now, encoded (`grab` + `record` on one thread)."""
    return record(grab(step, state, layout, ddp_layout, metrics, meta))


def collect(step: int, state: Mapping[str, Any], layout: Layout, ddp_layout: dict[str, str] | None,
            metrics: Any, meta: Any, *, skip: frozenset[str] = frozenset()) -> Captured:
    """This rank's small state now, with a digest per piece (`grab` then `finish`)."""
    return finish(grab(step, state, layout, ddp_layout, metrics, meta, skip=skip))


@dataclass
class Grab:
    """What the training thread takes at a capture, and nothing more: each entry's JSON text (what
    `dumps` of `jsonenc.encode` of its value gives), each per-rank tensor's bytes (a copy), the RNG
    states (copies, as bytes: `rng.Capturer.raw`), metrics and meta as JSON text. Nothing in it
    changes when training goes on, so `record` may run later, on another thread."""

    step: int
    entries: dict[str, str]  # key -> the entry's JSON text
    tensors: dict[str, tuple[str, list[int], bytes]]
    missing: list[str]
    rng: dict[str, Any]  # as bytes (`rng.Capturer.raw`)
    ddp: dict[str, str] | None
    metrics: str  # JSON text
    meta: str  # JSON text


class _Json(str):
    """An entry's JSON text, as `dumps` of its encoded value gives it (`_OptimizerText`)."""


def grab(step: int, state: Mapping[str, Any], layout: Layout, ddp_layout: dict[str, str] | None,
         metrics: Any, meta: Any, *, skip: frozenset[str] = frozenset(),
         rng_state: dict[str, Any] | None = None) -> Grab:
    """The training thread's part of a capture (see `Grab`). `skip`: state keys left out (a tail
    snapshot leaves out what always changes after an optimizer step: the writer takes those from
    its own boundary). `rng_state`: the RNG states already taken, as bytes (`rng.Capturer.raw`;
    else `rng.capture()`, turned into bytes)."""
    own: dict[str, Any] = {}
    if layout.cheap:
        entries = _cheap_texts(state, layout, own, skip)
    else:  # the save's own naming, every key (a tensor shared between keys, a GPU tensor: rare)
        skeleton, flat = flatten(state, {})
        entries = {k: dumps(v) for k, v in skeleton["entries"].items() if k not in skip}
        own = {n: t for n, t in flat if n not in layout.replicated and n.split("/", 1)[0] not in skip}
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    missing: list[str] = []
    if own:
        size = 0
        for name, t in own.items():
            size += t.numel() * t.element_size()
            if t.device.type != "cpu" or size > PUBLISH_MAX_BYTES:
                missing.append(name)
            else:
                tensors[name] = (str(t.dtype).removeprefix("torch."), list(t.shape), rng.tensor_bytes(t))
    return Grab(step, entries, tensors, missing, rng_state if rng_state is not None else rng.as_raw(rng.capture()),
                ddp_layout, _fast_text(metrics, None), _fast_text(meta, None))


def finish(g: Grab) -> Captured:
    """A grab with its digests (`Captured`)."""
    return Captured(g)


def record(g: Grab, *, tail_of: int | None = None, tail_changed: list[str] | None = None) -> list[bytes]:
    """The record a slot holds (`snappub.FileSink` writes it): header, JSON, raw bytes (the RNG states, then the tensors), in
    as few steps as a capture on a cold cache allows (each distinct call costs microseconds there:
    docs/benchmarks.md). `tail_of`: a tail snapshot's boundary (the one it follows); `tail_changed`:
    a boundary's pieces that ever changed between an optimizer step and the boundary after it, on
    this rank."""
    version, words, gauss = g.rng["python"]
    numpy_state = g.rng["numpy"]
    name, keys, pos, has_gauss, cached = numpy_state
    cpu = g.rng["torch_cpu"]
    a, b = len(words), len(words) + len(keys)
    at = b + len(cpu)
    parts = [words, keys, cpu]
    kept = _RNG_TEXT[0]
    if kept is not None and kept[0] is numpy_state and gauss is None and kept[1] == (version, a, len(cpu)):
        rng_text = kept[2]  # the same NumPy state object (`rng.Capturer`: unchanged), the same lengths
    else:
        rng_text = (f'{{"python":[{version},0,{a},{"null" if gauss is None else _float(gauss)}],'
                    f'"numpy":[{_key_json(name)},{a},{len(keys)},{pos},{has_gauss},{_float(cached)}],'
                    f'"torch_cpu":[{b},{len(cpu)}]')
        _RNG_TEXT[0] = (numpy_state, (version, a, len(cpu)), rng_text) if gauss is None else None
    if "torch_cuda" in g.rng:
        cuda = []
        for state in g.rng["torch_cuda"]:
            cuda.append(f"[{at},{len(state)}]")
            parts.append(state)
            at += len(state)
        rng_text += f',"torch_cuda":[{",".join(cuda)}]'
    tensors = "{}"
    if g.tensors:
        listed = []
        for tname, (dtype, shape, raw) in g.tensors.items():
            listed.append(f"{_key_json(tname)}:[{_key_json(dtype)},[{','.join(map(str, shape))}],{at},{len(raw)}]")
            parts.append(raw)
            at += len(raw)
        tensors = "{" + ",".join(listed) + "}"
    more = f',"tail_of":{int(tail_of)}' if tail_of is not None else ""
    if tail_changed is not None:
        more += f',"tail_changed":{_fast_text(tail_changed, None)}'
    text = (f'{{"entries":{{{",".join([f"{_key_json(k)}:{t}" for k, t in g.entries.items()])}}},'
            f'"step":{g.step},"rng":{rng_text}}},"ddp":{_ddp_text(g.ddp)},"metrics":{g.metrics},'
            f'"meta":{g.meta},"tensors":{tensors},"missing":{_fast_text(g.missing, None)}{more}}}').encode()
    body = b"".join([text, *parts])  # one buffer, one digest call (a few KB: a copy costs less than the calls)
    return [HEADER.pack(len(text), at, xxhash.xxh3_64_intdigest(body)), body]


def _ddp_text(layouts: dict[str, str] | None) -> str:
    """`_fast_text(layouts or None)`, kept for the very dict of the previous call: the guard hands
    every capture the one layout dict it keeps once DDP rebuilt its buckets, never changed in
    place (`FailureGuard._ddp_layout`); the kept reference also keeps its id from being reused."""
    kept = _DDP_TEXT[0]
    if kept is not None and kept[0] is layouts:
        return kept[1]
    text = _fast_text(layouts or None, None)
    _DDP_TEXT[0] = (layouts, text)
    return text


_DDP_TEXT: list[tuple[Any, str] | None] = [None]  # (the layouts dict of the last record, its text)
# the RNG description of the last record without a cached Python Gaussian: (its NumPy state tuple,
# kept so that its id is not reused; Python's version, Python's and torch's lengths; the text)
_RNG_TEXT: list[tuple[Any, tuple[int, int, int], str] | None] = [None]


def _float(x: float) -> str:
    """A finite float's JSON text (its repr, as `json` writes it); any other value is refused."""
    if type(x) is not float or x - x != 0.0:
        raise ValueError(f"an RNG state holds {x!r}, not a finite float")
    return float.__repr__(x)


def changed(tail: Mapping[str, Any], boundary: Mapping[str, Any]) -> set[str]:
    """Pure: the pieces whose values differ between a step's tail capture and its boundary (a
    piece only one of them has counts as changed). The values: digests (`digests`)."""
    return {p for p in set(tail) | set(boundary) if tail.get(p) != boundary.get(p)}


def moved(tail: Grab, g: Grab) -> set[str]:
    """Pure: the pieces that differ between a tail capture and its boundary (`changed` of their
    pieces), compared by their bytes: each entry's text, the RNG states (every byte and scalar),
    each published tensor's dtype, shape and bytes; a piece only one of them has counts."""
    te, ge = tail.entries, g.entries
    out = {f"entry:{k}" for k in te.keys() ^ ge.keys()}
    out.update(f"entry:{k}" for k, text in ge.items() if k in te and te[k] != text)
    if tail.rng != g.rng:
        out.add("rng")
    if tail.tensors or g.tensors:
        tt, gt = tail.tensors, g.tensors
        out.update(f"tensor:{n}" for n in tt.keys() | gt.keys() if tt.get(n) != gt.get(n))
    return out


def digests(snap: Mapping[str, Any]) -> dict[str, str]:
    """A published record's digest per piece (`read`'s result): each entry's JSON text, the RNG
    states (their scalars and bytes), each tensor (dtype, shape, bytes). Derived by the reader, so
    the training thread never hashes a piece."""
    blob = snap["blob"]
    out = {f"entry:{k}": _xxh(dumps(v).encode()) for k, v in snap["entries"].items()}
    for name, (dtype, shape, at, size) in snap["tensors"].items():
        h = xxhash.xxh3_64(dumps([dtype, shape]).encode())
        h.update(blob[at:at + size])
        out[f"tensor:{name}"] = h.hexdigest()
    raw = snap["rng"]
    slices = [raw["python"][1:3], raw["numpy"][1:3], raw["torch_cpu"], *raw.get("torch_cuda", ())]
    h = xxhash.xxh3_64(dumps([raw["python"][0], raw["python"][3], raw["numpy"][0], *raw["numpy"][3:],
                              [size for _, size in slices]]).encode())
    for at, size in slices:
        h.update(blob[at:at + size])
    out["rng"] = h.hexdigest()
    return out


def splice(base: dict[str, Any], donor: dict[str, Any], pieces: set[str] | frozenset[str]) -> dict[str, Any]:
    """Pure: a dead rank's snapshot at the donor's step, made of its tail snapshot (`base`, taken
    at its last optimizer step) with `pieces` taken from a survivor's boundary snapshot (`donor`)
    instead: the pieces that change after an optimizer step and are the same on every rank
    (`survivors.plan` decided which). The donor's raw bytes are appended to the base's."""
    shift = len(base["blob"])
    out = {k: v for k, v in base.items() if k not in ("tail_of", "blob")}
    out.update(step=donor["step"], metrics=donor.get("metrics"), meta=donor.get("meta"),
               blob=base["blob"] + donor["blob"])
    entries = dict(base["entries"])
    tensors = dict(base["tensors"])
    for piece in pieces:
        kind, _, name = piece.partition(":")
        if kind == "entry":
            if name in donor["entries"]:
                entries[name] = donor["entries"][name]
            else:
                entries.pop(name, None)
        elif kind == "tensor":
            if name in donor["tensors"]:
                d, shape, at, size = donor["tensors"][name]
                tensors[name] = [d, shape, at + shift, size]
            else:
                tensors.pop(name, None)
        elif piece == "rng":
            out["rng"] = _shift_rng(donor["rng"], shift)
    out["entries"], out["tensors"] = entries, tensors
    return out


def _shift_rng(raw: dict[str, Any], shift: int) -> dict[str, Any]:
    version, w_at, w_size, gauss = raw["python"]
    name, k_at, k_size, *rest = raw["numpy"]
    out = {"python": [version, w_at + shift, w_size, gauss], "numpy": [name, k_at + shift, k_size, *rest],
           "torch_cpu": [raw["torch_cpu"][0] + shift, raw["torch_cpu"][1]]}
    if "torch_cuda" in raw:
        out["torch_cuda"] = [[at + shift, size] for at, size in raw["torch_cuda"]]
    return out


def _xxh(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def read(path: Path) -> dict[str, Any] | None:
    """A published snapshot (its raw bytes under "blob"), or None when the slot is empty or torn."""
    try:
        return read_bytes(path.read_bytes())
    except OSError:
        return None


def cut(data: bytes) -> bytes:
    """A slot file's bytes up to the end of the record its header names (a slot is a fixed-size
    mapped file, `snappub.FileSink`: what follows is zeros or an older, longer record); bytes
    whose header does not fit are returned whole (`read_bytes` refuses them)."""
    try:
        n_text, n_blob, _ = HEADER.unpack_from(data)
    except struct.error:
        return data
    end = HEADER.size + n_text + n_blob
    return data[:end] if end <= len(data) else data


def read_bytes(data: bytes) -> dict[str, Any] | None:
    """`read` of a record already in memory."""
    try:
        n_text, n_blob, digest = HEADER.unpack_from(data)
        body = data[HEADER.size:HEADER.size + n_text + n_blob]
        if len(body) != n_text + n_blob or xxhash.xxh3_64_intdigest(body) != digest:
            return None
        out = json.loads(body[:n_text])
    except (struct.error, ValueError):
        return None
    if not isinstance(out, dict) or not isinstance(out.get("step"), int):
        return None
    out["blob"] = body[n_text:]
    return out


def rebuild(snap: dict[str, Any], live_skeleton: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """The writer: rank's skeleton and its own tensors (library RNG + published per-rank ones),
    from its snapshot and the writer's own skeleton (`flatten` of its live state) for the static
    keys. Raises ValueError when the two do not have the same keys."""
    import torch

    live = live_skeleton["entries"]
    published = snap["entries"]
    if set(published) - set(live):
        raise ValueError(f"state keys {sorted(set(published) - set(live))} are not in the writer's state")
    entries = _merge(live, published)
    library: dict[str, Any] = {"rng": _rng_state(snap["rng"], snap["blob"])}
    if snap.get("ddp"):
        library["ddp"] = snap["ddp"]
    lib_skeleton, lib_tensors = flatten({}, library)
    blob = snap["blob"]
    own = [(n, torch.frombuffer(bytearray(blob[at:at + size]), dtype=getattr(torch, d)).reshape(shape).clone())
           for n, (d, shape, at, size) in snap["tensors"].items()]
    return {"entries": entries, "library": lib_skeleton["library"]}, [*lib_tensors, *own]


# -- parts -------------------------------------------------------------------------------------------

def _cheap_texts(state: Mapping[str, Any], layout: Layout, own: dict[str, Any],
                skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """This rank's entries as JSON text, without the parts that are replicas only (nor `skip`),
    tensors named by path."""
    def name(path: list[str], t: Any) -> str:
        n = "/".join(path)
        if n not in layout.replicated:
            own[n] = t
        return n

    out: dict[str, str] = {}
    for key, obj in state.items():
        if key in layout.static or key in skip:
            continue
        memo = layout.texts.get(key)
        if memo is not None:
            text = memo.text(obj, key, name)
            if text is not None:
                out[key] = text
                continue
            del layout.texts[key]  # not torch's own state_dict() any more: the general path from now on
        # `is_stateful`, then `as_stateful(obj).state_dict()`, in fewer calls: a plain value (a loss)
        # never is; else the object's own two methods, or a torch.Generator's state
        sd = None if type(obj) in _SCALARS else getattr(obj, "state_dict", None)
        if (callable(sd) and callable(getattr(obj, "load_state_dict", None))) \
                or (sd is None and type(obj) not in _SCALARS and is_stateful(obj)):
            value = sd() if sd is not None else as_stateful(obj).state_dict()
            replicas = layout.parts.get(key)
            if replicas and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k not in replicas}
            out[key] = f'{{"kind":"stateful","value":{_fast_text(value, name, (None, key))}}}'
        else:
            out[key] = f'{{"kind":"value","value":{_fast_text(obj, name, (None, key))}}}'
    return out


def _fast_text(obj: Any, on_tensor: Any, where: Any = None) -> str:
    """`dumps(jsonenc.encode(obj, on_tensor, path))`, the same text, in one pass and without
    `json`'s encoder (its first call on a cache the step evicted costs ~40 us) for plain dicts,
    lists, tuples, str, bool, None, small ints and finite floats (the text of an int and a float
    is their repr, as `json` writes them); anything else (a tensor, NumPy, a non-finite float, a
    dict with other keys) by `encode` and `dumps`. `where`: the path as (parent, key) links,
    turned into `encode`'s list only when `encode` needs it."""
    t = type(obj)
    if t is float and obj - obj == 0.0:  # finite (inf - inf and nan - nan are nan)
        return float.__repr__(obj)
    if t is str:
        return _key_json(obj)
    if obj is None:
        return "null"
    if t is bool:
        return "true" if obj else "false"
    if t is int and -_FAST_INT < obj < _FAST_INT:
        return int.__repr__(obj)
    if t is dict:
        if (len(obj) == 1 and next(iter(obj)) in TAGS) or not all(type(k) is str for k in obj):
            return dumps(encode(obj, on_tensor, _path(where)))
        return "{" + ",".join([f"{_key_json(k)}:{_fast_text(v, on_tensor, (where, k))}" for k, v in obj.items()]) + "}"
    if t is list:
        if all(type(v) is int for v in obj) and (not obj or min(obj) > -_FAST_INT and max(obj) < _FAST_INT):
            return "[" + ",".join(map(int.__repr__, obj)) + "]"  # an optimizer's parameter indices
        return "[" + ",".join([_fast_text(v, on_tensor, (where, i)) for i, v in enumerate(obj)]) + "]"
    if t is tuple:
        return '{"__tuple__":[' + ",".join([_fast_text(v, on_tensor, (where, i)) for i, v in enumerate(obj)]) + "]}"
    return dumps(encode(obj, on_tensor, _path(where)))


_FAST_INT = 1 << 62
_SCALARS = (float, int, bool, str, type(None))  # immutable: the same object encodes the same


class _OptimizerText:
    """A torch optimizer's entry (its `param_groups`; its per-parameter "state" holds replicas
    only) as the JSON text that `dumps` of the general path's value gives, kept between captures:
    a group's value that is the very object of the previous capture and immutable (a float, int,
    bool, str, None, or a tuple of those) keeps its text, so a step where only `lr` moved encodes
    one float, not every hyper-parameter and parameter index again. Rebuilt (and checked once
    against the general path) whenever the groups' parameters or keys change. Only for an
    optimizer whose `state_dict()` is torch's own (no override, no state_dict hooks): `text`
    returns None otherwise, and the caller takes the general path for good."""

    def __init__(self) -> None:
        self._params: list[list[Any]] = []  # each group's parameters (the objects: identity)
        self._keys: list[tuple[str, ...]] = []  # each group's keys, in order ("params" included)
        self._values: list[list[Any]] = []  # each group's values at the last capture (params: None)
        self._pieces: list[list[str]] = []  # `"key":<json>` of each value, and last `"params":[...]`

    @staticmethod
    def applies(opt: Any) -> bool:
        try:
            from torch.optim import Optimizer
        except ImportError:  # pragma: no cover - a state with an optimizer has torch
            return False
        return isinstance(opt, Optimizer) and type(opt).state_dict is Optimizer.state_dict \
            and "state_dict" not in vars(opt)

    def text(self, opt: Any, key: str, name: Any) -> _Json | None:
        """The entry's JSON now (`name`: the caller's tensor naming), or None: not torch's own
        `state_dict()` (a hook, an override), or not what the general path gives."""
        if opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks or "state_dict" in vars(opt):
            return None
        groups = opt.param_groups
        if len(groups) != len(self._params) or any(
                len(g["params"]) != len(p) or not all(map(operator.is_, g["params"], p)) or tuple(g) != k
                for g, p, k in zip(groups, self._params, self._keys, strict=True)):
            return self._rebuild(opt, key, name)
        for i, (group, values, pieces, keys) in enumerate(zip(groups, self._values, self._pieces, self._keys,
                                                              strict=True)):
            now = list(group.values())  # in the keys' order (checked above), "params" among them
            at = keys.index("params")
            del now[at]
            # the positions whose value is not the very object of the last capture, found without a
            # Python-level loop over every hyper-parameter (a step's cold cache: ~1 us a line)
            for n in itertools.compress(range(len(now)), map(operator.is_not, now, values)):
                v = now[n]
                values[n] = v if _immutable(v) else _CHANGING
                pieces[n] = _piece(keys[n if n < at else n + 1], v, name, key, i)
        return self._join()

    def _rebuild(self, opt: Any, key: str, name: Any) -> _Json | None:
        """From the groups (torch's packing: parameter indices in order of first appearance),
        checked against the general path's text (a mismatch: None)."""
        mapping: dict[int, int] = {}
        self._params, self._keys, self._values, self._pieces = [], [], [], []
        for i, group in enumerate(opt.param_groups):
            params = group["params"]
            mapping.update({id(p): j for j, p in enumerate(params, len(mapping)) if id(p) not in mapping})
            others = [(k, v) for k, v in group.items() if k != "params"]
            self._params.append(list(params))
            self._keys.append(tuple(group))
            self._values.append([v if _immutable(v) else _CHANGING for _, v in others])
            self._pieces.append([_piece(k, v, name, key, i) for k, v in others]
                                + [f'"params":{dumps([mapping[id(p)] for p in params])}'])
        got = self._join()
        value = {k: v for k, v in opt.state_dict().items() if k != "state"}
        want = dumps({"kind": "stateful", "value": encode(value, lambda path, t: "/".join(path), [key])})
        return got if got == want else None

    def _join(self) -> _Json:
        groups = ",".join("{" + ",".join(pieces) + "}" for pieces in self._pieces)
        return _Json('{"kind":"stateful","value":{"param_groups":[' + groups + "]}}")


_CHANGING = object()  # a value that may change in place (a list, a tensor): encoded at every capture


def _immutable(v: Any) -> bool:
    return type(v) in _SCALARS or (type(v) is tuple and all(type(x) in _SCALARS for x in v))


def _piece(k: str, v: Any, name: Any, key: str, group: int) -> str:
    """`"k":<json of v>` as the general path encodes group `group`'s value `v` of optimizer `key`
    (a finite float: its repr, as `json` writes it)."""
    if type(v) is float and v - v == 0.0:
        return f"{_key_json(k)}:{v!r}"
    return f"{_key_json(k)}:{_fast_text(v, name, ((((None, key), 'param_groups'), group), k))}"


_KEYS: dict[str, str] = {}


def _key_json(k: str) -> str:
    """`dumps(k)` of a dict key or a short string value, kept (a state's and an optimizer group's
    few keys; the strings of a state_dict)."""
    text = _KEYS.get(k)
    if text is None:
        text = dumps(k)
        if len(_KEYS) < 4096 and len(k) <= 64:
            _KEYS[k] = text
    return text


def _path(where: Any) -> list[str]:
    out = []
    while where is not None:
        where, key = where
        out.append(str(key))
    return out[::-1]


def _merge(live: dict[str, Any], published: dict[str, Any]) -> dict[str, Any]:
    """Pure: the entries of a rank, its published ones completed by the writer's (`live`) for
    what was left out as replicas only: whole keys, or top-level parts of a stateful value."""
    out = {}
    for key, entry in live.items():
        mine = published.get(key)
        if mine is None:
            out[key] = entry
        elif mine["kind"] == "stateful" and isinstance(entry["value"], dict) and isinstance(mine["value"], dict):
            value = {k: mine["value"].get(k, v) for k, v in entry["value"].items()}
            out[key] = {"kind": "stateful", "value": value}
        else:
            out[key] = mine
    return out


def _replicas_only(value: Any, replicated: set[str]) -> bool:
    leaves = list(_leaves(value))
    return bool(leaves) and all(isinstance(v, dict) and v.get("__tensor__") in replicated for v in leaves)


def _leaves(data: Any) -> Any:
    """The values of encoded `data` (a dict with non-string keys: its values, not its keys)."""
    if isinstance(data, dict) and len(data) == 1 and "__dict__" in data and isinstance(data["__dict__"], list):
        for pair in data["__dict__"]:
            yield from _leaves(pair[1] if isinstance(pair, list) and len(pair) == 2 else pair)
    elif isinstance(data, dict) and not (len(data) == 1 and "__tensor__" in data):
        for v in data.values():
            yield from _leaves(v)
    elif isinstance(data, list):
        for v in data:
            yield from _leaves(v)
    else:
        yield data


def _rng_state(raw: dict[str, Any], blob: bytes) -> dict[str, Any]:
    """Pure: from a record's "rng" (`record`) what `rng.capture` returned on that rank at that step."""
    import torch

    def piece(at: int, size: int) -> bytes:
        return blob[at:at + size]

    def tensor(where: list[int]) -> Any:
        return torch.frombuffer(bytearray(piece(*where)), dtype=torch.uint8).clone()

    version, w_at, w_size, gauss = raw["python"]
    name, k_at, k_size, pos, has_gauss, cached = raw["numpy"]
    out: dict[str, Any] = {"python": (version, tuple(array.array("I", piece(w_at, w_size))), gauss),
                           "numpy": (name, np.frombuffer(piece(k_at, k_size), dtype=np.uint32).copy(), pos, has_gauss,
                                     cached),
                           "torch_cpu": tensor(raw["torch_cpu"])}
    if "torch_cuda" in raw:
        out["torch_cuda"] = [tensor(w) for w in raw["torch_cuda"]]
    return out

"""What to write: turn the user's state mapping into (JSON skeleton, named tensors), and back.

State is a mapping of names to either objects with `state_dict()/load_state_dict()` (model,
optimizer, scheduler, sampler) or plain values (step, epoch, metrics, nested containers).
Tensors that share storage (tied weights) are stored once and come back as one tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Container, Iterable, Iterator, Mapping, MutableMapping
from typing import Any, cast

from ..errors import ConfigError, CorruptCheckpointError
from .dtensorspec import describe, is_dtensor
from .jsonenc import decode, encode
from .landed import meta_path

RESERVED = "__slurmresume__"


def is_stateful(obj: Any) -> bool:
    return _is_generator(obj) or (callable(getattr(obj, "state_dict", None))
                                  and callable(getattr(obj, "load_state_dict", None)))


def _is_generator(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Generator)


class GeneratorState:
    """A `torch.Generator` seen as a stateful object (it has get_state/set_state instead), so a
    script-owned generator (`state["gen"] = g`) is saved and restored in place."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        return {"rng_state": self.gen.get_state(), "device": str(self.gen.device)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        # set_state reads the tensor's storage from offset 0: hand it a tensor that owns its bytes
        self.gen.set_state(owned(state["rng_state"]).cpu())


def as_stateful(obj: Any) -> Any:
    """The object whose state_dict()/load_state_dict() stands for `obj` in a checkpoint."""
    return GeneratorState(obj) if _is_generator(obj) else obj


def owned(t: Any) -> Any:
    """`t` itself when it owns exactly its bytes (offset 0, the whole storage, contiguous), else a
    copy that does. Every tensor handed to user code goes through here."""
    if t.device.type == "meta" or is_dtensor(t):
        return t
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes:
        return t
    c = t.contiguous()
    return c if c is not t else t.clone()


class TensorTable:
    """Collects tensors under unique names; the same storage view gets the same name."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, Any]] = []
        self.live: dict[str, Any] = {}  # name -> the tensor as found in the state (DTensors too)
        self.dtensors: dict[str, dict[str, Any]] = {}  # name -> spec (dtensorspec.describe) of a DTensor
        self.devices: dict[str, str] = {}  # name -> device of a tensor not on the CPU ("cuda:0")
        self._names: set[str] = set()
        self._by_view: dict[tuple[Any, ...], str] = {}

    def add(self, path: list[str], tensor: Any) -> str:
        original, spec = tensor, None
        if is_dtensor(tensor):  # stored as this rank's local piece + its place in the global tensor
            tensor, spec = describe(tensor, "/".join(path))
        key = _view_key(tensor)
        if key is not None and spec is not None:
            key = ("dtensor", *key)
        if key is not None and key in self._by_view:
            return self._by_view[key]
        name = base = "/".join(path) or "tensor"
        i = 1
        while name in self._names:
            name, i = f"{base}~{i}", i + 1
        self._names.add(name)
        self.tensors.append((name, tensor))
        self.live[name] = original
        if spec is None and tensor.device.type != "cpu":
            self.devices[name] = str(tensor.device)
        if spec is not None:
            self.dtensors[name] = spec
        if key is not None:
            self._by_view[key] = name
        return name


def _view_key(t: Any) -> tuple[Any, ...] | None:
    if t.numel() == 0:
        return None
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def flatten(state: Mapping[str, Any], extra: Mapping[str, Any]) -> tuple[dict[str, Any], list[tuple[str, Any]]]:
    """Skeleton (plain JSON) + tensors for one rank. `extra` holds library-owned entries (RNG).
    A DTensor contributes its local tensor; the skeleton's "dtensors" maps its name to its
    global shape, this rank's offset and local shape, and its placements."""
    skeleton, table = _flatten(state, extra)
    return skeleton, table.tensors


def flatten_live(state: Mapping[str, Any]) -> dict[str, Any]:
    """Name -> tensor as it is in `state` now (DTensors as DTensors): the restore's targets."""
    return _flatten(state, {})[1].live


def _flatten(state: Mapping[str, Any], extra: Mapping[str, Any]) -> tuple[dict[str, Any], TensorTable]:
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict of name -> object, got {type(state).__name__}")
    table = TensorTable()
    entries: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key or key == RESERVED:
            raise ConfigError(f"state key {key!r} is not allowed: use a non-empty string")
        if is_stateful(obj):
            value = as_stateful(obj).state_dict()
            entries[key] = {"kind": "stateful", "value": encode(value, table.add, [key])}
        elif hasattr(obj, "state_dict") or hasattr(obj, "load_state_dict"):
            raise ConfigError(
                f"state['{key}'] ({type(obj).__name__}) has only one of state_dict/load_state_dict"
            )
        else:
            entries[key] = {"kind": "value", "value": encode(obj, table.add, [key])}
    lib = encode(dict(extra), table.add, [RESERVED])
    skeleton = {"entries": entries, "library": lib}
    if table.dtensors:
        skeleton["dtensors"] = table.dtensors
    if table.devices:
        skeleton["devices"] = table.devices
    return skeleton, table


def unflatten_into(state: MutableMapping[str, Any], skeleton: Any, tensors: Mapping[str, Any],
                   strict: bool = True) -> dict[str, Any]:
    """Load a skeleton back: call load_state_dict on stateful objects, assign plain values into
    `state`. Returns the library-owned entries. Missing keys raise when `strict`. Everything is
    decoded (and a malformed checkpoint refused) before any object in `state` is modified."""
    decoded, library = decode_entries(list(state), skeleton, tensors, strict)
    check_fits(state, decoded)
    apply_entries(state, decoded)
    return cast(dict[str, Any], library)


def validate_skeleton(keys: Iterable[str], skeleton: Any, tensor_names: Container[str] | None = None,
                      strict: bool = True, specs: bool = True) -> set[str]:
    """Check a skeleton before anything is read into user objects: its structure, that every
    state key in `keys` has an entry (when `strict`), and, given the shard's tensor names (from
    its header), that every tensor it references exists. CorruptCheckpointError for a bad
    checkpoint; ConfigError for a key the checkpoint lacks (a mismatch between the training
    script and the checkpoint: an older checkpoint would not have it either). `specs` False:
    the "dtensors" section is only checked to be a mapping (a restore reads its placements
    alone, for the tensors without a live DTensor, and checks those: boxes.targets; it may be
    `deferred.Deferred`, parsed then). Returns the tensor names the entries and the library
    reference, given `tensor_names` (else an empty set): `referenced` of every key."""
    if not isinstance(skeleton, dict) or not isinstance(skeleton.get("entries"), dict):
        raise CorruptCheckpointError("checkpoint skeleton is malformed (no 'entries')")
    entries = skeleton["entries"]
    for key, entry in entries.items():
        if not isinstance(entry, dict) or "value" not in entry or entry.get("kind") not in ("stateful", "value"):
            raise CorruptCheckpointError(f"checkpoint skeleton entry {key!r} is malformed")
    devices = skeleton.get("devices", {})
    if not (isinstance(devices, dict) and all(isinstance(v, str) and len(v) < 64 for v in devices.values())):
        raise CorruptCheckpointError("checkpoint skeleton's 'devices' is not a map of tensor name -> device")
    if "dtensors" in skeleton:
        from .sharding import check_specs

        section = skeleton["dtensors"]
        if specs:  # (a Deferred section: parsed here)
            check_specs(dict(section) if isinstance(section, Mapping) and not isinstance(section, dict) else section)
        elif not isinstance(section, Mapping):
            raise CorruptCheckpointError("checkpoint skeleton: 'dtensors' is not an object")
    missing = [k for k in keys if k not in entries]
    if missing and strict:
        raise ConfigError(f"checkpoint has no entry for state key(s) {missing}; saved keys: "
                          f"{sorted(entries)}: pass restore(..., strict=False) to load the others")
    if tensor_names is None:
        return set()
    refs = list(_tensor_refs([entries, skeleton.get("library")]))  # tags live there (what decode reads)
    names = set(refs) if set(map(type, refs)) <= {str} else None  # (one pass in C: 4,549 names at 405B)
    if names is None or not all(map(tensor_names.__contains__, names)):
        for name in refs:
            if not isinstance(name, str) or name not in tensor_names:
                raise CorruptCheckpointError(f"checkpoint references tensor {name!r} that its shard lacks")
    return names if names is not None else set()


def referenced(skeleton: Any, keys: Iterable[str]) -> set[str]:
    """Tensor names that the entries for `keys` and the library entries refer to."""
    entries = skeleton.get("entries") or {} if isinstance(skeleton, dict) else {}
    values = [entries[k].get("value") for k in keys if isinstance(entries.get(k), dict)]
    values.append(skeleton.get("library") if isinstance(skeleton, dict) else None)
    return {n for n in _tensor_refs(values) if isinstance(n, str)}


def _tensor_refs(data: Any) -> Iterator[Any]:
    stack = [data]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):  # first: most items are the references themselves
            if len(item) == 1 and "__tensor__" in item:
                yield item["__tensor__"]
            else:
                stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def decode_entries(keys: Iterable[str], skeleton: Any, tensors: Mapping[str, Any],
                   strict: bool = True, checked: bool = False) -> tuple[dict[str, tuple[str, Any]], Any]:
    """Phase 1 of a load, touching no user object: validate the skeleton and decode the entries
    for `keys`. Returns ({key: (kind, value)}, library entries). Raises CorruptCheckpointError for
    a malformed skeleton or a missing tensor (a caller may fall back to an older checkpoint), and
    ConfigError (from `validate_skeleton`) for a state key the checkpoint lacks when `strict`.
    `checked`: the caller validated this skeleton for these keys already (not again)."""

    def lookup(name: str) -> Any:
        try:
            return owned(tensors[name])
        except (KeyError, TypeError):
            raise CorruptCheckpointError(f"checkpoint references tensor {name!r} that its shard lacks") from None

    wanted = list(keys)
    if not checked:
        validate_skeleton(wanted, skeleton, None, strict)
    entries = skeleton["entries"]
    devices = skeleton.get("devices") or {}

    def lookup_value(name: str) -> Any:  # a plain value: back to the device it was saved from
        t = lookup(name)
        return _to_device(t, saved_device(devices.get(name), t.device.type))

    decoded = {k: (entries[k]["kind"], decode(entries[k]["value"], lookup_value if entries[k]["kind"] == "value"
                                              else lookup)) for k in wanted if k in entries}
    return decoded, decode(skeleton.get("library", {}), lookup)


def saved_device(recorded: str | None, loaded_type: str, cuda_devices: int | None = None) -> str | None:
    """Where a plain tensor saved from `recorded` ("cuda:1"; None = the CPU) goes now: None to
    leave it where it was loaded (the CPU, or "meta" for shape checks). A CUDA device this process
    does not have (fewer GPUs, or none) becomes the current CUDA device, or the CPU without CUDA.
    Pure given `cuda_devices` (None: ask torch)."""
    if recorded is None or loaded_type == "meta" or not recorded.startswith("cuda"):
        return None
    if cuda_devices is None:
        import torch

        cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_devices == 0:
        return None
    index = recorded.partition(":")[2]
    return recorded if index.isdigit() and int(index) < cuda_devices else "cuda"


def live_device(saved: Any, live: Any) -> Any:
    """Move the tensors of a decoded plain value onto the device of the live value at the same
    place (a hidden state or prefetched batch already on the GPU stays there). Pure structure
    walk; values without a live tensor counterpart are returned unchanged."""
    import torch

    if isinstance(saved, torch.Tensor):
        return _to_device(saved, str(live.device)) if isinstance(live, torch.Tensor) and not is_dtensor(live) \
            and live.device.type != "meta" else saved
    if isinstance(saved, dict) and isinstance(live, Mapping):
        return {k: live_device(v, live[k]) if k in live else v for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        moved = [live_device(a, b) for a, b in zip(saved, live, strict=True)]
        return moved if isinstance(saved, list) else type(saved)(moved) if type(saved) is tuple else saved
    return saved


def into_live(saved: Any, live: Any) -> Any:
    """What a decoded plain value becomes in `state`: the live objects themselves wherever they
    can take it. A live tensor (or DTensor on the same mesh and placements) of the same shape and
    dtype receives the saved bytes in place; a live dict or list is refilled in place (its
    entries by the same rule); anything else is the saved value, on the live value's device
    (`live_device`). Copies only: call it after every check has passed."""
    import torch

    if isinstance(saved, torch.Tensor) and isinstance(live, torch.Tensor):
        if not _same_layout(saved, live):
            return live_device(saved, live)
        with torch.no_grad():  # a leaf that requires grad is still the user's object to refill
            _local(live).copy_(_local(saved))
        return live
    if type(saved) is dict and type(live) is dict:
        merged = {k: into_live(v, live[k]) if k in live else v for k, v in saved.items()}
        live.clear()
        live.update(merged)
        return live
    if type(saved) is list and type(live) is list and len(saved) == len(live):
        live[:] = [into_live(a, b) for a, b in zip(saved, live, strict=True)]
        return live
    return live_device(saved, live)


def _local(t: Any) -> Any:
    return t.to_local() if is_dtensor(t) else t


def _same_layout(saved: Any, live: Any) -> bool:
    if saved.dtype != live.dtype or tuple(saved.shape) != tuple(live.shape) or live.device.type == "meta":
        return False
    if is_dtensor(saved) or is_dtensor(live):
        return (is_dtensor(saved) and is_dtensor(live) and saved.device_mesh == live.device_mesh
                and tuple(saved.placements) == tuple(live.placements)
                and tuple(_local(saved).shape) == tuple(_local(live).shape))
    return True


def _to_device(t: Any, device: str | None) -> Any:
    if device is None or str(t.device) == device:
        return t
    return t.to(device)


def apply_entries(state: MutableMapping[str, Any], decoded: Mapping[str, tuple[str, Any]]) -> None:
    """Phase 2: load decoded entries into `state` (all type checks before the first change):
    `load_state_dict` on stateful objects, plain values through `into_live`."""
    for key, (kind, _) in decoded.items():
        if kind == "stateful" and not is_stateful(state[key]):
            raise ConfigError(f"state['{key}'] was saved from an object with state_dict(); "
                              f"got {type(state[key]).__name__} now")
    for key, (kind, value) in decoded.items():
        if kind == "stateful":
            as_stateful(state[key]).load_state_dict(value)
        else:
            state[key] = into_live(value, state.get(key))


def check_fits(state: Mapping[str, Any], decoded: Mapping[str, tuple[str, Any]]) -> None:
    """Before anything is loaded: every saved stateful value must fit its live object (a module:
    the same keys; everywhere: a tensor of the same shape where the live state has a tensor), so
    that `load_state_dict` cannot fail half-way and leave some keys loaded. `decoded` may hold
    shape-only (meta) tensors. ConfigError naming the first mismatch."""
    import torch

    for key, (kind, value) in decoded.items():
        obj = state.get(key)
        if kind != "stateful" or obj is None or not is_stateful(obj):
            continue
        live = as_stateful(obj).state_dict()
        on_meta = meta_path(live) or next((f"param_groups[{i}]" for i, g in enumerate(getattr(obj, "param_groups", ()))
                                           if isinstance(obj, torch.optim.Optimizer) and meta_path(g.get("params"))), None)
        if on_meta:  # torch's copy into a meta tensor does nothing but warn: refused before anything loads
            raise ConfigError(f"state['{key}'] has tensors on the meta device ('{on_meta}'), which a restore cannot "
                              f"write: materialise it first (e.g. model.to_empty(device='cuda'), then the optimizer "
                              f"over its parameters) and restore into that")
        module = isinstance(obj, torch.nn.Module)
        compiled = compile_mismatch(live, value, f"state['{key}']") if module and isinstance(value, Mapping) else None
        if compiled:
            raise ConfigError(compiled)
        problem = _mismatch(live, value, module, key)
        if problem is None and isinstance(obj, torch.optim.Optimizer):
            problem = _param_groups_mismatch(live, value, key)
        if problem:
            raise ConfigError(f"the checkpoint does not fit state['{key}']: {problem}; was it saved by "
                              "another model or optimizer configuration?")


COMPILED = "_orig_mod"  # torch.compile's OptimizedModule holds the model as this submodule


def compile_mismatch(live: Mapping[str, Any], saved: Mapping[str, Any], path: str) -> str | None:
    """Pure: when the two modules' keys differ only by torch.compile's "_orig_mod." (at any depth,
    e.g. "module._orig_mod." under DDP), what to put in `state` instead; else None."""
    def plain(keys: Iterable[Any]) -> set[str]:
        return {".".join(p for p in str(k).split(".") if p != COMPILED) for k in keys}

    if set(live) == set(saved) or plain(live) != plain(saved):
        return None
    if any(COMPILED in str(k).split(".") for k in live):
        return (f"every key of {path} differs from the checkpoint's by '{COMPILED}.': it is a torch.compile'd "
                f"module and the checkpoint was saved from the module itself: put `compiled.{COMPILED}` in state "
                f"(the same parameters, keys without the prefix), in this run and the next")
    return (f"every key of the checkpoint of {path} carries '{COMPILED}.': it was saved from a torch.compile'd module "
            f"and {path} is the module itself: put torch.compile(module) in state to load it (and from then on "
            f"prefer `compiled.{COMPILED}`, which saves keys without the prefix)")


def _param_groups_mismatch(live: Any, saved: Any, path: str) -> str | None:
    """An optimizer's parameter grouping (how many groups, how many parameters in each) must be
    the same, or `Optimizer.load_state_dict` raises a bare ValueError after the model loaded."""
    def sizes(sd: Any) -> list[int] | None:
        groups = sd.get("param_groups") if isinstance(sd, Mapping) else None
        if not isinstance(groups, (list, tuple)):
            return None
        return [len(g["params"]) if isinstance(g, Mapping) and isinstance(g.get("params"), (list, tuple)) else -1
                for g in groups]

    here, saved_sizes = sizes(live), sizes(saved)
    if here is None or saved_sizes is None or here == saved_sizes:
        return None
    return (f"{path}.param_groups: {len(here)} group(s) of {here} parameters here, {len(saved_sizes)} group(s) of "
            f"{saved_sizes} in the checkpoint (another parameter grouping, e.g. weight-decay groups)")


def _mismatch(live: Any, saved: Any, exact_keys: bool, path: str) -> str | None:
    import torch

    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            return f"{path} is a tensor here, {type(saved).__name__} in the checkpoint"
        if tuple(live.shape) != tuple(saved.shape):
            return f"{path} has shape {list(live.shape)} here, {list(saved.shape)} in the checkpoint"
        return None
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return f"{path} is a mapping here, {type(saved).__name__} in the checkpoint"
        if exact_keys and set(live) != set(saved):
            missing, extra = sorted(map(str, set(live) - set(saved))), sorted(map(str, set(saved) - set(live)))
            return f"keys missing from the checkpoint {missing[:3]}, unexpected keys {extra[:3]}"
        pairs = [(k, live[k], saved[k]) for k in live if k in saved]
    elif isinstance(live, (list, tuple)) and isinstance(saved, (list, tuple)) and len(live) == len(saved):
        pairs = list(zip(range(len(live)), live, saved, strict=True))
    else:
        return None
    for k, a, b in pairs:
        problem = _mismatch(a, b, False, f"{path}.{k}")
        if problem:
            return problem
    return None

"""What to write: turn the user's state mapping into (JSON skeleton, named tensors), and back.

State is a mapping of names to either objects with `state_dict()/load_state_dict()` (model,
optimizer, scheduler, sampler) or plain values (step, epoch, metrics, nested containers).
Tensors that share storage (tied weights) are stored once and come back as one tensor.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from ..errors import ConfigError, CorruptCheckpointError
from .jsonenc import decode, encode

RESERVED = "__slurmresume__"


def is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class TensorTable:
    """Collects tensors under unique names; the same storage view gets the same name."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, Any]] = []
        self._names: set[str] = set()
        self._by_view: dict[tuple, str] = {}

    def add(self, path: list[str], tensor: Any) -> str:
        key = _view_key(tensor)
        if key is not None and key in self._by_view:
            return self._by_view[key]
        name = base = "/".join(path) or "tensor"
        i = 1
        while name in self._names:
            name, i = f"{base}~{i}", i + 1
        self._names.add(name)
        self.tensors.append((name, tensor))
        if key is not None:
            self._by_view[key] = name
        return name


def _view_key(t: Any) -> tuple | None:
    if t.numel() == 0:
        return None
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype)


def flatten(state: Mapping[str, Any], extra: Mapping[str, Any]) -> tuple[dict, list[tuple[str, Any]]]:
    """Skeleton (plain JSON) + tensors for one rank. `extra` holds library-owned entries (RNG)."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict of name -> object, got {type(state).__name__}")
    table = TensorTable()
    entries: dict[str, Any] = {}
    for key, obj in state.items():
        if not isinstance(key, str) or not key or key == RESERVED:
            raise ConfigError(f"state key {key!r} is not allowed: use a non-empty string")
        if is_stateful(obj):
            value = obj.state_dict()
            entries[key] = {"kind": "stateful", "value": encode(value, table.add, [key])}
        elif hasattr(obj, "state_dict") or hasattr(obj, "load_state_dict"):
            raise ConfigError(
                f"state['{key}'] ({type(obj).__name__}) has only one of state_dict/load_state_dict"
            )
        else:
            entries[key] = {"kind": "value", "value": encode(obj, table.add, [key])}
    lib = encode(dict(extra), table.add, [RESERVED])
    return {"entries": entries, "library": lib}, table.tensors


def unflatten_into(state: MutableMapping[str, Any], skeleton: Any, tensors: Mapping[str, Any],
                   strict: bool = True) -> dict[str, Any]:
    """Load a skeleton back: call load_state_dict on stateful objects, assign plain values into
    `state`. Returns the library-owned entries. Missing keys raise when `strict`."""

    def lookup(name: str) -> Any:
        try:
            return tensors[name]
        except KeyError:
            raise CorruptCheckpointError(f"checkpoint references tensor {name!r} that its shard lacks") from None

    if not isinstance(skeleton, dict) or "entries" not in skeleton:
        raise CorruptCheckpointError("checkpoint skeleton is malformed (no 'entries')")
    entries = skeleton["entries"]
    missing = [k for k in state if k not in entries]
    if missing and strict:
        raise CorruptCheckpointError(
            f"checkpoint has no entry for state key(s) {missing}; saved keys: {sorted(entries)}"
        )
    for key, entry in entries.items():
        if key not in state:
            continue
        value = decode(entry["value"], lookup)
        target = state[key]
        if entry.get("kind") == "stateful":
            if not is_stateful(target):
                raise ConfigError(f"state['{key}'] was saved from an object with state_dict(); "
                                  f"got {type(target).__name__} now")
            target.load_state_dict(value)
        else:
            state[key] = value
    return decode(skeleton.get("library", {}), lookup)

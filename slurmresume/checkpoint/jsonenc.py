"""Exact JSON round-trip for non-tensor state, with a tagged encoding. Nothing is unpickled.

Plain JSON covers None, bool, int, str, finite float, list and str-keyed dict. Everything
else becomes a one-key object whose key is a tag:

  {"__tuple__": [...]}                   tuple
  {"__dict__": [[k, v], ...]}            dict with non-str keys (or a key that looks like a tag)
  {"__float__": "nan"|"inf"|"-inf"}      non-finite float
  {"__bytes__": "<base64>"}              bytes
  {"__ndarray__": {dtype, shape, data}}  small NumPy array (e.g. the MT19937 key)
  {"__npscalar__": [dtype, value]}       NumPy scalar
  {"__tensor__": "name"}                 a tensor stored in the safetensors shard
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import ConfigError, UnsafeCheckpointError

TAGS = frozenset(
    {"__tuple__", "__dict__", "__float__", "__bytes__", "__ndarray__", "__npscalar__", "__tensor__"}
)
MAX_JSON_BYTES = 256 << 20  # a skeleton or manifest larger than this is refused
_INT_MAX_BITS = 14000  # about 4200 decimal digits, under Python's default int<->str limit (4300)
_ND_MAX = 64 << 20  # bytes of an inline ndarray; bigger arrays belong in tensors

TensorHook = Callable[[list[str], Any], str]


def encode(obj: Any, on_tensor: TensorHook | None = None, path: list[str] | None = None) -> Any:
    """Turn `obj` into plain JSON data. Tensors go through `on_tensor(path, tensor) -> name`."""
    path = path or []
    if isinstance(obj, np.generic):  # first: np.float64 / np.str_ / np.bytes_ subclass Python types
        # .item() and str() drop trailing NULs of np.str_ / np.bytes_; these keep them
        item = (str.__str__(obj) if isinstance(obj, np.str_) else bytes(obj) if isinstance(obj, np.bytes_)
                else obj.item())
        if isinstance(item, np.generic):  # np.longdouble & co have no exact Python equivalent
            raise ConfigError(f"cannot checkpoint NumPy scalar at '{'/'.join(path) or '<top>'}' of "
                              f"dtype {obj.dtype}: convert it to float or to a tensor")
        return {"__npscalar__": [obj.dtype.str, encode(item, None, path)]}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int) and not isinstance(obj, bool):
        if obj.bit_length() > _INT_MAX_BITS:  # Python refuses to print/parse > 4300 digits
            raise ConfigError(f"integer at '{'/'.join(path) or '<top>'}' has {obj.bit_length()} bits, "
                              f"more than the {_INT_MAX_BITS} a checkpoint stores: store it as a string")
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {"__float__": "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")}
    if isinstance(obj, list):
        return [encode(v, on_tensor, path + [str(i)]) for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {"__tuple__": [encode(v, on_tensor, path + [str(i)]) for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        return _encode_dict(obj, on_tensor, path)
    if isinstance(obj, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(obj)).decode("ascii")}
    if isinstance(obj, np.ndarray):
        return _encode_ndarray(obj, path)
    if on_tensor is not None and _is_tensor(obj):
        return {"__tensor__": on_tensor(path, obj)}
    where = "/".join(path) or "<top>"
    raise ConfigError(
        f"cannot checkpoint value at '{where}' of type {type(obj).__name__}: "
        "use tensors, numbers, strings, lists, tuples, dicts, or an object with state_dict()"
    )


def _encode_dict(obj: dict[str, Any], on_tensor: TensorHook | None, path: list[str]) -> Any:
    plain = all(isinstance(k, str) for k in obj) and not (len(obj) == 1 and next(iter(obj)) in TAGS)
    if plain:
        return {k: encode(v, on_tensor, path + [k]) for k, v in obj.items()}
    return {"__dict__": [[encode(k), encode(v, on_tensor, path + [str(k)])] for k, v in obj.items()]}


def _encode_ndarray(arr: np.ndarray, path: list[str]) -> Any:
    if arr.dtype.hasobject or arr.nbytes > _ND_MAX:
        raise ConfigError(
            f"NumPy array at '{'/'.join(path)}' ({arr.dtype}, {arr.nbytes} bytes) cannot be "
            "stored inline: convert it to a torch tensor"
        )
    data = np.ascontiguousarray(arr).tobytes()
    return {
        "__ndarray__": {
            "dtype": arr.dtype.str,
            "shape": list(arr.shape),
            "data": base64.b64encode(data).decode("ascii"),
        }
    }


def _is_tensor(obj: Any) -> bool:
    import torch

    return isinstance(obj, torch.Tensor)


def decode(data: Any, tensors: Callable[[str], Any] | None = None) -> Any:
    """Inverse of `encode`. `tensors(name)` supplies the tensor for each `__tensor__` tag."""
    if isinstance(data, list):
        return [decode(v, tensors) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1:
        (tag, value), = data.items()
        if tag in TAGS:
            return _decode_tag(tag, value, tensors)
    return {k: decode(v, tensors) for k, v in data.items()}


def _decode_tag(tag: str, value: Any, tensors: Callable[[str], Any] | None) -> Any:
    try:
        if tag == "__tuple__":
            return tuple(decode(v, tensors) for v in value)
        if tag == "__dict__":
            return {_hashable(decode(k)): decode(v, tensors) for k, v in value}
        if tag == "__float__":
            return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[value]
        if tag == "__bytes__":
            return base64.b64decode(value, validate=True)
        if tag == "__ndarray__":
            dtype = np.dtype(value["dtype"])
            if dtype.hasobject:
                raise UnsafeCheckpointError(f"object arrays are refused (dtype {dtype})")
            raw = base64.b64decode(value["data"], validate=True)
            return np.frombuffer(raw, dtype=dtype).reshape(value["shape"]).copy()
        if tag == "__npscalar__":
            dtype = np.dtype(value[0])
            if dtype.hasobject:
                raise UnsafeCheckpointError(f"object scalars are refused (dtype {dtype})")
            return dtype.type(decode(value[1]))  # the value may itself be tagged (nan, bytes)
        if tensors is None:
            raise UnsafeCheckpointError(f"tensor reference {value!r} where no tensors are allowed")
        return tensors(value)
    except UnsafeCheckpointError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise UnsafeCheckpointError(f"malformed {tag} value in checkpoint JSON: {exc}") from exc


def _hashable(key: Any) -> Any:
    if isinstance(key, list):
        raise UnsafeCheckpointError("a list cannot be a dict key")
    return key


def dumps(data: Any) -> str:
    """Compact JSON; refuses NaN (the tagged encoding must have removed every non-finite float)."""
    return json.dumps(data, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def strict_decoder(what: str) -> json.JSONDecoder:
    """A decoder with `loads`'s rules (no duplicate keys, no NaN/Infinity literals:
    UnsafeCheckpointError naming `what`): its `raw_decode` parses one value of a text."""
    pairs, constant = _hooks(what)
    return json.JSONDecoder(object_pairs_hook=pairs, parse_constant=constant)


def _hooks(what: str) -> tuple[Callable[[list[tuple[str, Any]]], dict[str, Any]], Callable[[str], Any]]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)  # in C: a Python loop per key was most of a restore plan's parse time
        if len(out) != len(items):
            seen: set[str] = set()
            dup = next(k for k, _ in items if k in seen or seen.add(k))  # type: ignore[func-returns-value]
            raise UnsafeCheckpointError(f"{what} has duplicate key {dup!r}")
        return out

    def constant(name: str) -> Any:
        raise UnsafeCheckpointError(f"{what} contains the non-JSON literal {name}")

    return pairs, constant


def loads(text: str | bytes, what: str) -> Any:
    """Parse untrusted JSON: bounded size, no duplicate keys, no NaN/Infinity literals."""
    if not isinstance(text, (str, bytes, bytearray)):
        raise UnsafeCheckpointError(f"{what} is a {type(text).__name__}, not JSON text")
    if len(text) > MAX_JSON_BYTES:
        raise UnsafeCheckpointError(f"{what} is {len(text)} bytes, over the {MAX_JSON_BYTES} limit")
    pairs, constant = _hooks(what)
    try:
        return json.loads(text, object_pairs_hook=pairs, parse_constant=constant)
    except RecursionError as exc:
        raise UnsafeCheckpointError(f"{what} is nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        if isinstance(exc, UnsafeCheckpointError):
            raise
        raise UnsafeCheckpointError(f"{what} is not valid JSON: {exc}") from exc

"""Did a restore's bytes land? A load that silently writes nothing must not be called restored.

`load_state_dict` can copy nothing and say nothing: into a module built on the meta device torch
only warns ("copying to a meta parameter is a no-op"), and a hand-written `load_state_dict` may
forget a tensor. Training then goes on from whatever the memory held. Two checks, both cheap:

- `meta_path` (before anything is read): a live tensor on the meta device cannot be written;
  `state.check_fits` refuses it with the module, all or nothing, at no cost.
- `Landing` (around the apply): a few elements of every tensor of each module (`checked`:
  where a copy can be a no-op, and state_dict shows what was loaded), sampled
  before `load_state_dict` and after it, and the same elements of the checkpoint's (verified)
  tensor. A tensor whose sample did not change although the checkpoint's differs was not
  written. It reads SAMPLES elements per tensor, gathered per device and dtype into one
  copy, so a GPU model costs a few small transfers, not a second copy of its bytes. A copy that
  writes only part of a tensor is not something `copy_` does; the check is aimed at the loads
  that write nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from .dtensorspec import is_dtensor

SAMPLES = 16  # evenly spaced elements per tensor


def meta_path(obj: Any, path: str = "") -> str | None:
    """The path of the first tensor on the meta device in a (live) state_dict value, or None."""
    for where, t in tensors(obj, path):
        if _local(t).device.type == "meta":
            return where or "(the value itself)"
    return None


def tensors(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(path, tensor) of every tensor in a state_dict value (dicts, lists and tuples walked)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        if isinstance(v, (torch.Tensor, Mapping, list, tuple)):  # not a call per int of a param group
            yield from tensors(v, f"{path}.{k}" if path else str(k))


def _local(t: Any) -> Any:
    # the class first: hasattr on a plain tensor's missing attribute costs ~0.1 ms (is_dtensor)
    return t.to_local() if getattr(type(t), "to_local", None) is not None and is_dtensor(t) else t


def _views(t: Any) -> list[Any]:
    """SAMPLES evenly spaced elements of `t` as a 1-D view (no copy for a contiguous tensor)."""
    flat = _local(t).reshape(-1)
    step = max(1, flat.numel() // SAMPLES)
    return [flat[: step * SAMPLES : step]]


def _fetch(items: list[tuple[Any, list[Any]]]) -> dict[Any, bytes]:
    """{id: the bytes of its views}, each (device, dtype) group concatenated and copied to the CPU
    once."""
    import torch

    groups: dict[tuple[str, Any], list[tuple[Any, list[Any]]]] = {}
    for ident, views in items:
        groups.setdefault((str(views[0].device), views[0].dtype), []).append((ident, views))
    out: dict[Any, bytes] = {}
    for members in groups.values():
        flat = torch.cat([v for _, views in members for v in views]).cpu().contiguous()
        raw = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        size, pos = flat.element_size(), 0
        for ident, views in members:
            n = sum(v.numel() for v in views) * size
            out[ident] = raw[pos : pos + n]
            pos += n
    return out


def _readable(t: Any) -> bool:
    """A plain strided tensor with elements off the meta device (a tensor subclass, e.g. a
    quantized one, is left alone: its slicing and bytes are its own)."""
    import torch

    local = _local(t)
    return (type(local) in (torch.Tensor, torch.nn.Parameter) and local.layout == torch.strided
            and local.device.type != "meta" and local.numel() > 0)


def checked(obj: Any) -> bool:
    """Where a load can silently copy nothing and its `state_dict()` shows what was loaded:
    modules (`load_state_dict` copies into the live parameters and buffers: a no-op into meta,
    or an override that forgets a tensor). An optimizer's load replaces its state with new
    tensors and a generator's sets its state: neither copies into memory that may not take it.
    Any other object may keep what it is given for later (the integrations' holders do), so its
    `state_dict()` is no evidence either way."""
    import torch

    return isinstance(obj, torch.nn.Module)


def _judged(state: Mapping[str, Any], decoded: Mapping[str, tuple[str, Any]]) -> list[str]:
    """The state keys a restore loads through load_state_dict whose object is `checked`."""
    return [key for key, (kind, _) in decoded.items() if kind == "stateful" and checked(state.get(key))]


class Landing:
    """Samples of the live tensors of the stateful entries a restore is about to load (`before`),
    checked against the same elements after the load and in the checkpoint (`unchanged`)."""

    def __init__(self, samples: dict[tuple[str, str], bytes]) -> None:
        self.samples = samples

    @classmethod
    def before(cls, state: Mapping[str, Any], decoded: Mapping[str, tuple[str, Any]]) -> Landing:
        items = [((key, path), _views(t)) for key in _judged(state, decoded)
                 for path, t in tensors(state[key].state_dict()) if _readable(t)]
        return cls(_fetch(items))

    def unchanged(self, state: Mapping[str, Any], decoded: Mapping[str, tuple[str, Any]]) -> str | None:
        """After the load: the first tensor (as "state['key']: 'path'") whose sampled elements are
        what they were before although the checkpoint's differ, or that is on the meta device;
        None when every sampled tensor holds the checkpoint's values (or already held them)."""
        after, source = [], []
        for key in _judged(state, decoded):
            saved = dict(tensors(decoded[key][1]))
            for path, t in tensors(state[key].state_dict()):
                s = saved.get(path)
                if (key, path) not in self.samples or s is None or _local(s).numel() != _local(t).numel() or not _readable(s):
                    continue
                if _local(t).device.type == "meta":
                    return f"state['{key}']: '{path}' is on the meta device"
                if not _readable(t):
                    continue
                after.append(((key, path), _views(t)))
                # the checkpoint's elements as the live dtype holds them (copy_ casts the same way)
                source.append(((key, path), [v if v.dtype == t.dtype else v.to(t.dtype) for v in _views(s)]))
        now, want = _fetch(after), _fetch(source)
        for ident, got in now.items():
            if got == self.samples[ident] and want[ident] != got:
                return f"state['{ident[0]}']: '{ident[1]}' is unchanged"
        return None

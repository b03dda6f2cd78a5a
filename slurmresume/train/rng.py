"""Each rank's random number generator states: Python, NumPy's global RNG, torch CPU, CUDA."""

from __future__ import annotations

import array
import ctypes
import logging
import os
import random
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

log = logging.getLogger("slurmresume")


def capture() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(legacy=True),
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return state


class Capturer:
    """`capture()` (and `raw()`: the same states as bytes), with NumPy's global state taken again
    only when it changed: its key and position are read through the bit generator's documented
    ctypes view (2.5 KB, ~2 us; NumPy's own `get_state` copies them element by element, ~35 us),
    and when they and the previous
    capture's are the same and that capture had no cached Gaussian, the previous state is the
    state now (only `legacy_gauss` changes NumPy's legacy state without moving the key or the
    position, and only by *using* a cached Gaussian). The one case this would miss: a
    `np.random.set_state` between two captures to exactly the key and position it already had,
    with a cached Gaussian the previous capture did not have. Checked once against `get_state`
    at creation; anything unexpected (another bit generator, another layout) takes the full
    state every time.

    `raw()` reads Python's global generator the same way: CPython's `_random.Random` object holds
    `int index; uint32_t state[624]` right after its object header, which `random.getstate()`
    turns into a tuple of 625 ints (~30 us on a cold cache, and ~10 us more to pack them back into
    bytes); the view reads the same 2,500 bytes in ~1 us. It is checked at creation against
    `getstate` on a freshly seeded scratch generator (another layout, another interpreter: the
    tuple every time). torch's states are copied out of the tensors `get_state()` returns in one
    call (`_state_bytes`), checked at creation on a scratch generator against `tensor_bytes`."""

    _KEY_BYTES = 624 * 4 + 4  # mt19937_state: uint32 key[624]; int pos
    _PY_WORDS = 624  # _random.Random: int index; uint32_t state[624]

    def __init__(self) -> None:
        self._last: tuple[bytes, Any] | None = None  # (key and position, the full legacy state)
        self._last_raw: tuple[bytes, tuple[str, bytes, int, int, float]] | None = None  # the same, as `raw()` gives it
        self._gen: Any = None  # the bit generator whose state lies at _address
        self._address = 0
        self._view: memoryview | None = None  # its key and position, in place
        self._probe_ok = False
        try:
            self._probe_ok = self._probe() == _key_pos(np.random.get_state(legacy=True))
        except Exception:  # noqa: BLE001 - no probe: the full state every time
            self._probe_ok = False
        self._as_bytes: Any = tensor_bytes  # a generator state tensor's bytes (`_state_bytes` once checked)
        try:
            import torch

            probe = torch.Generator().manual_seed(12345).get_state()
            if probe.dtype == torch.uint8 and probe.device.type == "cpu" and probe.is_contiguous() \
                    and _state_bytes(probe) == tensor_bytes(probe):
                self._as_bytes = _state_bytes
        except Exception:  # noqa: BLE001 - tensor_bytes every time
            pass
        self._py: Any = getattr(random.getstate, "__self__", None)  # the global generator (getstate is bound to it)
        self._py_address = _py_state_address(self._py)
        self._py_views: tuple[memoryview, memoryview] | None = None  # its words, its index (in place)
        if self._py_address:
            import ctypes

            at = self._py_address
            self._py_views = (memoryview((ctypes.c_char * (4 * self._PY_WORDS)).from_address(at + 4)),
                              memoryview((ctypes.c_char * 4).from_address(at)))

    def capture(self) -> dict[str, Any]:
        import torch

        state: dict[str, Any] = {"python": random.getstate(), "numpy": self._numpy(), "torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_initialized() and torch.cuda.is_available():  # the cheap test first
            state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
        return state

    def raw(self) -> dict[str, Any]:
        """The states of `capture()` as bytes (what `as_raw(capture())` gives), in fewer and cheaper
        calls: Python's words and index, NumPy's key and position, torch's generator states."""
        import torch

        as_bytes = self._as_bytes
        state: dict[str, Any] = {"python": self._python_raw(), "numpy": self._numpy_raw(),
                                 "torch_cpu": as_bytes(torch.default_generator.get_state())}
        # torch.cuda's own flag first (one attribute; `is_initialized()` costs ~6 us on a cold cache)
        if getattr(torch.cuda, "_initialized", True) and torch.cuda.is_initialized() and torch.cuda.is_available():
            state["torch_cuda"] = [as_bytes(t) for t in torch.cuda.get_rng_state_all()]
        return state

    def _python_raw(self) -> tuple[int, bytes, Any]:
        if self._py_views is not None:  # copies made while this thread holds the GIL
            words, index = self._py_views
            return self._py.VERSION, words.tobytes() + index.tobytes(), self._py.gauss_next
        version, words, gauss = random.getstate()
        return version, array.array("I", words).tobytes(), gauss

    def _numpy_raw(self) -> tuple[str, bytes, int, int, float]:
        probe = self._probe() if self._probe_ok else None
        if probe is not None and self._last_raw is not None and self._last_raw[0] == probe \
                and not self._last_raw[1][3]:
            return self._last_raw[1]
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        out = (name, np.ascontiguousarray(keys, dtype=np.uint32).tobytes(), int(pos), int(has_gauss), float(cached))
        if probe is not None:
            self._last_raw = (out[1] + struct.pack("=i", out[2]), out)
        return out

    def _numpy(self) -> Any:
        if not self._probe_ok:
            return np.random.get_state(legacy=True)
        probe = self._probe()
        if self._last is not None and self._last[0] == probe and not self._last[1][3]:
            return self._last[1]
        full = np.random.get_state(legacy=True)
        self._last = (_key_pos(full), full)
        return full

    def _probe(self) -> bytes | None:
        gen = np.random.mtrand._rand._bit_generator
        if gen is not self._gen:  # the first call, or another bit generator
            if type(gen).__name__ != "MT19937":
                return None
            import ctypes

            self._gen, self._address = gen, gen.ctypes.state_address
            self._view = memoryview((ctypes.c_char * self._KEY_BYTES).from_address(self._address))
        assert self._view is not None  # set with _gen
        return self._view.tobytes()


def as_raw(state: Mapping[str, Any]) -> dict[str, Any]:
    """Pure: `capture()`'s states as `Capturer.raw()` gives them (Python's 625 words and NumPy's key
    as native uint32 bytes, torch's states as bytes)."""
    version, words, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    out: dict[str, Any] = {"python": (version, array.array("I", words).tobytes(), gauss),
                           "numpy": (name, np.ascontiguousarray(keys, dtype=np.uint32).tobytes(), int(pos),
                                     int(has_gauss), float(cached)),
                           "torch_cpu": tensor_bytes(state["torch_cpu"])}
    if "torch_cuda" in state:
        out["torch_cuda"] = [tensor_bytes(t) for t in state["torch_cuda"]]
    return out


def tensor_bytes(t: Any) -> bytes:
    """A CPU tensor's bytes, in order (a copy)."""
    import torch

    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _state_bytes(t: Any) -> bytes:
    """A generator state's bytes: `get_state()` gives a fresh, contiguous uint8 CPU tensor, copied
    here in one call (`tensor_bytes`' conversions cost ~15 us on a cache the step evicted);
    `Capturer` checks once that this gives `tensor_bytes`' result."""
    return ctypes.string_at(t.data_ptr(), t.numel())


def _py_state_address(inst: Any) -> int:
    """Where `inst`'s (a `random.Random`) `int index; uint32_t state[624]` lie, when a scratch
    generator of the same class, freshly seeded, reads there exactly as its `getstate()` says
    (and one draw later too); else 0 (no view: `getstate` every time)."""
    import ctypes

    try:
        base = random.Random.__mro__[1]  # _random.Random, the C type
        offset = object.__basicsize__  # the object header
        if type(inst) is not random.Random or base.__basicsize__ < offset + 4 + 4 * Capturer._PY_WORDS:
            return 0
        scratch = random.Random()
        for _ in range(2):
            scratch.seed(os.urandom(16))
            scratch.random()
            _, words, _ = scratch.getstate()
            at = id(scratch) + offset
            seen = ctypes.string_at(at + 4, 4 * Capturer._PY_WORDS) + ctypes.string_at(at, 4)
            if seen != array.array("I", words).tobytes():
                return 0
        return id(inst) + offset
    except Exception:  # noqa: BLE001 - no view: the tuple every time
        return 0


def _key_pos(legacy: Any) -> bytes:
    """NumPy's legacy state's key and position as the C struct lays them out."""
    return np.ascontiguousarray(legacy[1], dtype=np.uint32).tobytes() + struct.pack("=i", int(legacy[2]))


def validate(state: Any) -> None:
    """Check a decoded RNG state by applying it to scratch generators, so that a damaged one is
    refused (CorruptCheckpointError) while nothing has been restored yet, not half-way through."""
    import torch

    from ..errors import CorruptCheckpointError

    try:
        if not isinstance(state, dict):
            raise TypeError(f"expected a dict, got {type(state).__name__}")
        py = state["python"]
        random.Random().setstate((py[0], tuple(py[1]), py[2]))
        np.random.RandomState().set_state(state["numpy"])
        cpu = state["torch_cpu"]
        if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8:
            raise TypeError("torch_cpu is not a uint8 tensor")
        torch.Generator().set_state(cpu.clone())
        cuda = state.get("torch_cuda")
        if cuda is not None and not (isinstance(cuda, list)
                                     and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in cuda)):
            raise TypeError("torch_cuda is not a list of uint8 tensors")
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise CorruptCheckpointError(f"the saved RNG state is damaged ({type(exc).__name__}: {exc})") from None


def restore(state: dict[str, Any]) -> None:
    """Apply a state that `validate` accepted."""
    import torch

    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    np.random.set_state(state["numpy"])
    # clone: the loaded tensor may be a view into the shard buffer, and set_rng_state reads its
    # storage from offset 0 (a view there crashed the process)
    torch.set_rng_state(state["torch_cpu"].clone())
    cuda = state.get("torch_cuda")
    if cuda is not None:
        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            if len(cuda) != n:
                log.warning("checkpoint has CUDA RNG states for %d devices, this process sees %d; "
                            "restoring the first %d", len(cuda), n, min(n, len(cuda)))
            for i, s in enumerate(cuda[:n]):
                torch.cuda.set_rng_state(s.clone(), i)
        else:
            log.warning("checkpoint has CUDA RNG states but CUDA is not available: not restored")


def reseed(step: int, rank: int) -> None:
    """Deterministic fresh streams for a rank that has no saved RNG state (a larger world)."""
    import torch

    seed = (step * 1_000_003 + rank * 7919 + 12345) % (2**32)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

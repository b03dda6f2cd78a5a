"""Non-tensor state round-trips exactly through the tagged JSON encoding:
encode -> dumps -> loads -> decode gives back the same value with the same types (a tuple stays
a tuple, an int key stays an int, -0.0 keeps its sign, nan stays nan, numpy scalars keep their
dtype). Untrusted JSON is refused with UnsafeCheckpointError, never half-decoded."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurmresume import ConfigError, UnsafeCheckpointError
from slurmresume.checkpoint.jsonenc import TAGS, decode, dumps, encode, loads


def roundtrip(value: Any) -> Any:
    text = dumps(encode(value))  # strict JSON: loads() refuses NaN / Infinity literals
    return decode(loads(text, "test"))


def same(a: Any, b: Any) -> bool:
    """Exact equality including types, nan == nan, the sign of zero, and dict order."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, np.floating)):
        if math.isnan(a):
            return math.isnan(b)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, (np.str_, np.bytes_)):  # the dtype (<U1, |S3) is derived from the value
        return a == b
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return len(a) == len(b) and all(same(ka, kb) and same(va, vb)
                                        for (ka, va), (kb, vb) in zip(a.items(), b.items(), strict=True))
    return a == b


floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 1.7976931348623157e308])
ints = st.integers() | st.integers(min_value=-(2**1000), max_value=2**1000) | st.sampled_from(
    [2**63, -(2**63) - 1, 2**64, 10**300, 2**14000 - 1, -(2**14000) + 1])
np_scalars = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.integers(-(2**31), 2**31 - 1).map(np.int32),
    st.integers(0, 255).map(np.uint8),
    st.integers(0, 2**64 - 1).map(np.uint64),
    st.floats(allow_nan=True).map(np.float64),
    st.floats(width=32, allow_nan=True).map(np.float32),
    st.floats(width=16, allow_nan=True).map(np.float16),
    st.booleans().map(np.bool_),
    st.text(max_size=5).map(np.str_),
    st.binary(max_size=5).map(np.bytes_),
)
leaves = st.one_of(st.none(), st.booleans(), ints, floats, st.text(max_size=20), st.binary(max_size=20),
                   np_scalars)
keys = st.one_of(st.integers(), st.text(max_size=8), st.sampled_from(sorted(TAGS)), st.booleans(), st.none(),
                 st.tuples(st.integers(), st.text(max_size=3)), st.tuples())


def containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=8), children, max_size=4),
        st.dictionaries(keys, children, max_size=4),
        st.builds(lambda tag, v: {tag: v}, st.sampled_from(sorted(TAGS)), children),  # looks like a tag
    )


state_values = st.recursive(leaves, containers, max_leaves=25)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(state_values)
def test_roundtrip_is_exact(value: Any) -> None:
    assert same(roundtrip(value), value), value


@given(st.integers(0, 2**32 - 1), st.integers(0, 700), st.booleans())
@settings(max_examples=25, deadline=None)
def test_numpy_rng_state_roundtrip_continues_the_stream(seed: int, draws: int, gauss: bool) -> None:
    rs = np.random.RandomState(seed)
    rs.random_sample(draws)
    if gauss:
        rs.standard_normal()  # leaves a cached gaussian in the state (has_gauss=1)
    state = rs.get_state(legacy=True)
    back = roundtrip(state)
    assert same(back, state)
    assert isinstance(back, tuple) and back[1].dtype == np.uint32
    other = np.random.RandomState(0)
    other.set_state(back)
    assert np.array_equal(other.standard_normal(5), rs.standard_normal(5))


def test_global_rng_states_roundtrip() -> None:
    np.random.seed(5)
    np.random.rand(3)
    st_np = np.random.get_state()
    assert same(roundtrip(st_np), st_np)
    random.seed(9)
    st_py = random.getstate()
    back = roundtrip(st_py)
    assert same(back, st_py)
    random.random()
    random.setstate(back)
    after = random.random()
    random.setstate(st_py)
    assert after == random.random()


@pytest.mark.parametrize("value, expected", [
    ((1, 2), {"__tuple__": [1, 2]}),
    ({1: "a"}, {"__dict__": [[1, "a"]]}),
    ({"__tuple__": [1]}, {"__dict__": [["__tuple__", [1]]]}),
    ({"__tuple__": 1, "x": 2}, {"__tuple__": 1, "x": 2}),
    (float("-inf"), {"__float__": "-inf"}),
    (b"\x00\xff", {"__bytes__": "AP8="}),
    (np.int64(3), {"__npscalar__": ["<i8", 3]}),
    (np.float64(0.5), {"__npscalar__": ["<f8", 0.5]}),
])
def test_encoding_is_the_documented_one(value: Any, expected: Any) -> None:
    assert encode(value) == expected


def test_numpy_arrays_roundtrip() -> None:
    for arr in [np.arange(6, dtype=">i4").reshape(2, 3), np.zeros((0, 2)), np.array(3.5),
                np.array([True, False]), np.arange(8, dtype=np.float16)[::2]]:
        assert same(roundtrip(arr), arr)


@pytest.mark.parametrize("value, where", [
    ({"a": [1, object()]}, "a/1"),
    ({"cfg": {"fn": print}}, "cfg/fn"),
    ({"s": {1, 2}}, "s"),
    ({"x": np.array([object()])}, "x"),
    ({"ld": np.longdouble(1.5)}, "ld"),
    ({"c": 1j}, "c"),
    ({"big": [10**5000]}, "big/0"),
])
def test_unserialisable_value_names_its_path(value: Any, where: str) -> None:
    with pytest.raises(ConfigError, match=f"'{where}'"):
        encode(value)


@pytest.mark.parametrize("text", [
    '{"a": 1, "a": 2}',
    '[NaN]',
    '{"x": Infinity}',
    '{"__tuple__": 5}',
    '{"__dict__": [[[1], 2]]}',
    '{"__dict__": [1, 2]}',
    '{"__float__": "zero"}',
    '{"__bytes__": "***"}',
    '{"__ndarray__": {"dtype": "|O", "shape": [1], "data": ""}}',
    '{"__ndarray__": {"dtype": "<i4", "shape": [3], "data": "AAAAAA=="}}',
    '{"__npscalar__": ["|O", 1]}',
    '{"__npscalar__": ["<i8"]}',
    '{"__tensor__": "model/w"}',
    '[' * 100000 + ']' * 100000,
    '{"a": ',
])
def test_hostile_json_is_refused(text: str) -> None:
    with pytest.raises(UnsafeCheckpointError):
        decode(loads(text, "test input"))


def test_oversized_json_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    import slurmresume.checkpoint.jsonenc as je

    monkeypatch.setattr(je, "MAX_JSON_BYTES", 100)
    with pytest.raises(UnsafeCheckpointError, match="over the 100 limit"):
        je.loads(b"[" + b"1," * 60 + b"1]", "big input")

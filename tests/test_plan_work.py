"""Issue #50: a same-W restore plan's work is its own shard's. Its skeleton is parsed without the
DTensor specs, which it reads only for a tensor with no live DTensor (`checkpoint.deferred`): the
same objects as a whole strict parse, the same refusals, and the writer's key order that the
shortcut relies on. (The plan's calls not growing with W: tests/test_bench_scale.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from slurmresume.checkpoint.deferred import AFTER, DEFERRED, READ, Deferred, loads_skeleton
from slurmresume.checkpoint.jsonenc import dumps, loads
from slurmresume.errors import CorruptCheckpointError, UnsafeCheckpointError

SPEC = {"shape": [8, 4], "offset": [2, 0], "local_shape": [2, 4], "placements": ["shard:0"], "mesh_shape": [4],
        "mesh_arange": True}
ENTRIES = {"model": {"kind": "value", "value": {"w": {"__tensor__": "model/w"}, "n": [1, 2.5, None, "x"]}},
           "extra": {"kind": "value", "value": {"__tuple__": [1, {"__float__": "nan"}]}}}


def _skeleton(**more: Any) -> dict[str, Any]:
    return {"entries": ENTRIES, "library": {"rng": {"__tensor__": "__slurmresume__/rng/torch_cpu"}}, **more}


def _whole(parsed: Any) -> Any:
    """`parsed` with a Deferred section read (what a whole parse gives)."""
    if not isinstance(parsed, dict):
        return parsed
    return {k: dict(v) if isinstance(v, Deferred) else v for k, v in parsed.items()}


WRITTEN = [  # what the writer writes (state.flatten, commit.write_rank), compact (jsonenc.dumps)
    _skeleton(),
    _skeleton(dtensors={"model/w": SPEC}),
    _skeleton(dtensors={"model/w": SPEC}, replicated=["optim/state/0/step"]),
    _skeleton(dtensors={"model/w": SPEC}, devices={"model/b": "cuda:0"}, replicated=["a", ',"replicated":[]}']),
    _skeleton(dtensors={"devices": SPEC, "replicated": SPEC}, replicated=[]),  # DTensors of those names
    _skeleton(dtensors={"model/w": SPEC, "devices": SPEC}),  # ... the last one, no key after the section
    _skeleton(dtensors={"model/w": SPEC}, devices={"replicated": "cuda:1"}),
    _skeleton(dtensors={}, replicated=["x"]),
    {"entries": {"dtensors": {"kind": "value", "value": 1}}, "library": {}, "dtensors": {"a": SPEC}},
]


@pytest.mark.parametrize("skeleton", WRITTEN)
def test_a_written_skeleton_parses_to_what_the_whole_parse_gives_its_specs_when_read(skeleton: dict) -> None:
    text = dumps(skeleton)
    got = loads_skeleton(text, "skeleton")
    assert list(got) == list(skeleton)  # the keys, in the order written
    section = got.get(DEFERRED)
    if section is not None and not set(skeleton[DEFERRED]) & set(READ):  # (a DTensor so named: parsed whole)
        assert isinstance(section, Deferred) and not section.parsed  # kept as text until read
        assert bool(section) == bool(skeleton[DEFERRED]) and not section.parsed
    assert _whole(got) == loads(text, "skeleton") == json.loads(text)


@pytest.mark.parametrize("text", [
    json.dumps(_skeleton(dtensors={"a": SPEC}, replicated=["a"]), indent=1),  # not compact
    dumps({"library": {}, "dtensors": {"a": SPEC}, "entries": ENTRIES}),  # another order
    dumps({"entries": ENTRIES, "dtensors": {"a": SPEC}, "replicated": ["a"], "library": {}}),
    dumps({"entries": ENTRIES, "dtensors": {"a": SPEC}, "devices": {"a": "cuda:0"}, "other": 1}),
    dumps({"entries": ENTRIES, "dtensors": {"a": SPEC}, "replicated": ["a"], "devices": {"a": "cuda:0"}}),
    dumps({"library": {}, "dtensors": {"a": SPEC}}),  # no entries
    '{"entries":{},"dtensors":[1],"replicated":[]}',
])
def test_text_not_in_the_writers_shape_is_parsed_whole(text: str) -> None:
    got = loads_skeleton(text, "skeleton")
    assert not any(isinstance(v, Deferred) for v in got.values())
    assert got == loads(text, "skeleton")


def test_a_key_this_version_does_not_read_stays_with_the_unread_section() -> None:
    text = dumps({"entries": ENTRIES, "library": {}, "dtensors": {"a": SPEC}, "newer": {"x": [1]}})
    got = loads_skeleton(text, "skeleton")
    assert list(got) == ["entries", "library", DEFERRED] and not got[DEFERRED].parsed
    with pytest.raises(UnsafeCheckpointError, match="not valid JSON"):  # read, it is not one object: refused
        got[DEFERRED].get("a")


@pytest.mark.parametrize("text, message", [
    ('{"entries":{},"entries":{},"dtensors":{"a":1}}', "duplicate key 'entries'"),
    ('{"entries":{"a":NaN},"dtensors":{"a":1}}', "non-JSON literal NaN"),
    ('{"entries":{},"dtensors":{"a":1},"replicated":[],"replicated":[]}', "duplicate key 'replicated'"),
    ('{"entries":{},"dtensors":{"a":1},"devices":{"a":"x","a":"y"}}', "duplicate key 'a'"),
    ('{"entries":{},"dtensors":{"a":1}', "not valid JSON"),
    ('{"entries":{]},"dtensors":{"a":1}}', "not valid JSON"),
])
def test_what_the_whole_parse_refuses_is_refused_with_its_message(text: str, message: str) -> None:
    with pytest.raises(UnsafeCheckpointError, match=message):
        loads(text, "skeleton")
    with pytest.raises(UnsafeCheckpointError, match=message):
        _whole(loads_skeleton(text, "skeleton"))


@pytest.mark.parametrize("section, error, message", [
    ('{"a":1,"a":2}', UnsafeCheckpointError, "duplicate key 'a'"),
    ('{"a":NaN}', UnsafeCheckpointError, "non-JSON literal"),
    ('{"a":{"b":1}', UnsafeCheckpointError, "not valid JSON"),
])
def test_a_bad_spec_section_is_refused_when_read(section: str, error: type, message: str) -> None:
    got = loads_skeleton('{"entries":{},"library":{},"dtensors":' + section + '}', "skeleton of rank-00001")
    with pytest.raises(error, match=message):
        got[DEFERRED].get("a")
    with pytest.raises(CorruptCheckpointError, match="not an object"):
        Deferred("[1]", "its 'dtensors'").get("a")


def test_the_plan_validates_a_deferred_section_as_a_mapping_and_the_other_readers_parse_it() -> None:
    from slurmresume.checkpoint.state import validate_skeleton

    text = dumps({"entries": {}, "dtensors": {"x": {"shape": "not a shape"}}})
    validate_skeleton([], loads_skeleton(text, "s"), specs=False)  # the restore plan: placements where read
    with pytest.raises(CorruptCheckpointError):
        validate_skeleton([], loads_skeleton(text, "s"))  # every other reader: the whole section


def test_the_writer_puts_only_the_deferred_keys_after_the_dtensor_specs(monkeypatch: pytest.MonkeyPatch) -> None:
    """`deferred` finds where the specs end from what follows them: "devices" from state.flatten,
    "replicated" from commit.write_rank. A key written after "dtensors" must join AFTER."""
    import torch

    from slurmresume.checkpoint import state as state_mod

    class _DT(torch.Tensor):  # what state.flatten asks of a DTensor (dtensorspec.is_dtensor); describe() is replaced
        device_mesh = placements = None

        def to_local(self) -> Any:
            return torch.zeros(2)

    monkeypatch.setattr(state_mod, "describe", lambda dt, where: (dt.to_local(), dict(SPEC)))
    dt = torch.zeros(2).as_subclass(_DT)
    skeleton, _ = state_mod.flatten({"model": {"w": dt, "b": torch.zeros(1)}}, {"rng": torch.zeros(1)})
    assert DEFERRED in skeleton
    if torch.cuda.is_available():  # pragma: no cover - a GPU host: a device map is written too
        assert list(skeleton)[:3] == ["entries", "library", DEFERRED]
    keys = list({**skeleton, "devices": {}, "replicated": []})  # commit.write_rank adds "replicated" last
    assert keys[keys.index(DEFERRED) + 1:] == list(AFTER)

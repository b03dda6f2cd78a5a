"""A skeleton parsed without its "dtensors" section, which a restore seldom reads.

A shard's skeleton (`state.flatten`, plus `commit.write_rank`'s "replicated") is one JSON object:
"entries", "library", then "dtensors" (each DTensor's spec on the rank that saved it), "devices"
and "replicated", each when present. A restore reads the specs only for a DTensor that has no
live tensor (`boxes.targets`), and at 405B they are most of the skeleton: 3,411 specs, 595 KB,
4-6 ms of a restore plan's strict parse and as much again in freed objects. `loads_skeleton`
parses everything else strictly (`jsonenc`'s rules) and keeps "dtensors" as its text, parsed
(strictly) when first read (`Deferred`). The skeletons are the same objects as `jsonenc.loads`
would give, but for that one section; anything not in the writer's shape is parsed whole.

Where "dtensors" ends is found from the other end of the text: after it come at most "devices",
then "replicated" (the writer's order), each found by its last `,"name":` and kept only where
its value, parsed, ends the object (a name inside "dtensors" is followed by the section's own
closing brace at least). In JSON text `,"name":` is always a key (a `"` inside a string is
escaped, and one that closes a string is never followed by a letter), so the last
`,"replicated":` of a skeleton that has the key at its end is that key. A key a
restore reads ("entries" and "library" come first) anywhere in what would be the section, as a
key or a DTensor's name, and the skeleton is parsed whole: a key this version does not read
after "dtensors" is kept with the section, unread. The writer's order is pinned by
tests/test_plan_work.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from json import JSONDecoder
from typing import Any

from ..errors import CorruptCheckpointError
from .jsonenc import MAX_JSON_BYTES, loads, strict_decoder

DEFERRED = "dtensors"
AFTER = ("devices", "replicated")  # the keys a writer puts after DEFERRED, in this order
READ = ("entries", "library", *AFTER)  # the keys a restore reads besides DEFERRED


class Deferred(Mapping[str, Any]):
    """A JSON object kept as its text until first read, then parsed strictly once
    (UnsafeCheckpointError as `jsonenc.loads`; CorruptCheckpointError when it is not an object)."""

    __slots__ = ("_text", "_what", "_value")

    def __init__(self, text: str, what: str) -> None:
        self._text, self._what = text, what
        self._value: dict[str, Any] | None = None

    @property
    def parsed(self) -> bool:
        return self._value is not None

    def _object(self) -> dict[str, Any]:
        if self._value is None:
            value = loads(self._text, self._what)
            if not isinstance(value, dict):
                raise CorruptCheckpointError(f"{self._what} is not an object")
            self._value, self._text = value, ""
        return self._value

    def __getitem__(self, key: str) -> Any:
        return self._object()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self._object().get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self._object()

    def __iter__(self) -> Iterator[str]:
        return iter(self._object())

    def __len__(self) -> int:
        return len(self._object())

    def __bool__(self) -> bool:  # `specs or {}` asks this: not a reason to parse
        return bool(self._value) if self._value is not None else self._text != "{}"


def loads_skeleton(text: Any, what: str) -> Any:
    """`jsonenc.loads(text, what)`, but for a skeleton object's "dtensors" value: a `Deferred`.
    Text not in the writer's shape (not compact, another order, a problem anywhere) is parsed
    whole by `jsonenc.loads`, which refuses what it refuses."""
    if isinstance(text, str) and len(text) <= MAX_JSON_BYTES and text[:1] == "{" and text[-1:] == "}":
        try:
            split = _split(text, strict_decoder(what), what)
        except (ValueError, IndexError, RecursionError, CorruptCheckpointError):
            split = None  # the whole parse below says what is wrong
        if split is not None:
            return split
    return loads(text, what)


def _split(text: str, dec: JSONDecoder, what: str) -> dict[str, Any] | None:
    out: dict[str, Any] = {}
    at = 1
    while True:  # the keys before "dtensors", one value at a time (the C scanner, strict hooks)
        if text[at] != '"':
            return None
        key, at = dec.raw_decode(text, at)  # the key: a JSON string
        if text[at] != ":" or key in out:
            return None
        if key == DEFERRED:
            break
        out[key], at = dec.raw_decode(text, at + 1)
        if text[at] == "}":
            return out if at == len(text) - 1 else None
        if text[at] != ",":
            return None
        at += 1
    start, end = at + 1, len(text) - 1  # the section is text[start:end], less what follows it
    tail: dict[str, Any] = {}
    for name in reversed(AFTER):
        found = text.rfind(f',"{name}":', start, end)
        if found >= 0:
            value, stop = dec.raw_decode(text, found + len(name) + 4)
            if stop == end:  # its value ends the object: a key of the skeleton's own
                tail[name], end = value, found
    if "entries" not in out or text[start] != "{" or text[end - 1] != "}" or tail.keys() & out.keys():
        return None
    if any(text.find(f',"{name}":', start, end) >= 0 for name in READ):  # one it reads, out of order?
        return None  # (or a DTensor of that name: parsed whole)
    out[DEFERRED] = Deferred(text[start:end], f"{what}: its 'dtensors'")
    out.update((name, tail[name]) for name in AFTER if name in tail)
    return out

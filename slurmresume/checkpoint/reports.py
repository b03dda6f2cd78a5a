"""What the commit protocol (commit.py) says about one save, typed where it is made: rank 0's
`PrepareDecision` (prepare), each rank's `WriteReport` (write_rank) and rank 0's `SaveOutcome`
(commit). Callers (train/saving.py, train/failwrite.py) receive these records and pass them on;
each is turned into JSON (`to_json`) only where it crosses ranks or processes (a collective, a
file between the writers of a failure save) and back (`from_json`) right after, and a
`WriteReport` becomes the manifest's shard row in `commit` (`build_manifest` reads `to_json`).

`from_json` trusts its input only as far as the peer that sent it: a missing key is a bug in
this module, so it raises KeyError rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class PrepareDecision:
    """Rank 0 -> all, before anything is written: "write" into the private directory `dir`
    (`replace`: swap out a complete committed step at the commit), "skip" (already committed),
    or "error" (nothing was created; `error` says why). What `commit.prepare` returns."""

    action: str
    dir: str = ""
    replace: bool = False
    error: str = ""
    explore: str = ""  # the write path every rank explores on this save, "" for none (checkpoint.bandit)

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "dir": self.dir, "replace": self.replace, "error": self.error,
                "explore": self.explore}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PrepareDecision:
        return cls(str(d["action"]), str(d.get("dir") or ""), bool(d.get("replace")), str(d.get("error") or ""),
                   str(d.get("explore") or ""))


@dataclass(frozen=True)
class WriteReport:
    """Each rank -> rank 0, after writing its shard and its tensor index: a fixed-size record of
    what the manifest lists for it (sizes and checksums; `pinned`: it holds a per-rank plain
    tensor), or the error that stops the commit. Only rank 0's own report carries the
    per-tensor section (`sharded`, `replicated`), which it never sends. What
    `commit.write_rank` returns and `commit.commit` reads."""

    rank: int
    file: str
    bytes: int = 0
    xxh3: str = ""
    header_xxh3: str = ""
    index: str = ""
    index_bytes: int = 0
    index_xxh3: str = ""
    pinned: bool = False
    error: str | None = None
    writer: str | None = None  # the write path used (checkpoint.calibrate), for the save event
    sharded: dict[str, Any] = field(default_factory=dict)  # rank 0 only
    replicated: tuple[str, ...] = ()  # rank 0 only
    timing: dict[str, float] | None = None  # where this rank's write spent its seconds (the save's breakdown)
    listed: bool = False  # holds a DTensor piece not placed by arithmetic (commit.unplaced)

    def to_json(self) -> dict[str, Any]:
        """The dict `build_manifest` reads (a failed write: only the rank, the file and the error)."""
        if self.error is not None:
            return {"rank": self.rank, "file": self.file, "error": self.error}
        out = {"rank": self.rank, "file": self.file, "bytes": self.bytes, "xxh3": self.xxh3,
               "header_xxh3": self.header_xxh3, "index": self.index, "index_bytes": self.index_bytes,
               "index_xxh3": self.index_xxh3, "pinned": self.pinned, "error": None, "writer": self.writer,
               "timing": self.timing, "listed": self.listed}
        if self.rank == 0:
            out.update(sharded=self.sharded, replicated=list(self.replicated))
        return out

    def record(self) -> dict[str, Any]:
        """What crosses ranks: the report without rank 0's per-tensor section (fixed size)."""
        return {k: v for k, v in self.to_json().items() if k not in ("sharded", "replicated")}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WriteReport:
        if d.get("error") is not None:
            return cls(int(d["rank"]), str(d["file"]), error=str(d["error"]))
        return cls(int(d["rank"]), str(d["file"]), int(d["bytes"]), str(d["xxh3"]), str(d["header_xxh3"]),
                   str(d["index"]), int(d["index_bytes"]), str(d["index_xxh3"]), bool(d.get("pinned")), None,
                   str(d["writer"]) if d.get("writer") is not None else None, dict(d.get("sharded") or {}),
                   tuple(d.get("replicated") or ()),
                   dict(d["timing"]) if isinstance(d.get("timing"), dict) else None, bool(d.get("listed")))


@dataclass(frozen=True)
class SaveOutcome:
    """Rank 0 -> all, after the commit: `ok` when `path` (step_N) is published and durable.
    What `commit.commit` returns."""

    ok: bool
    path: str = ""
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "path": self.path, "error": self.error}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SaveOutcome:
        return cls(bool(d["ok"]), str(d.get("path") or ""), str(d.get("error") or ""))

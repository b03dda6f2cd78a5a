"""What ranks tell each other during a restore: small frozen dataclasses, each turned into a
JSON-able dict (`to_json`) right before a collective (`Group.all_gather_json` /
`broadcast_json`) and back (`from_json`) right after it. Nothing else crosses ranks. A save's
records (PrepareDecision, WriteReport, SaveOutcome) live where the commit protocol makes them,
in checkpoint/reports.py.

An error crosses ranks as data, `Failure(kind, message)`, and becomes the same exception on
every rank through one table (`KINDS`), never by looking up an exception class by its name.
`from_json` trusts its input only as far as the peer that sent it: a missing key is a bug in
this module, so it raises KeyError rather than guessing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.bounded import UNREADABLE
from ..errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    PeerReadError,
    RankFailedError,
    SlurmResumeError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
)

# kind -> the exception every rank raises; most specific class first (classify picks the first match)
KINDS: dict[str, type[Exception]] = {
    "unsafe": UnsafeCheckpointError,
    "peer": PeerReadError,  # reported after every other failure: the reader's own error says why
    "corrupt": CorruptCheckpointError,
    "unreadable": UnreadableCheckpointError,
    "config": ConfigError,
    "checkpoint": CheckpointError,
    "bug": RankFailedError,
}
# kinds that end a restore on every rank at once: the live state does not fit the checkpoint (an
# older step would not fit either), an unexpected exception, or a step this version or this user
# cannot read (never skipped for an older step: a later save would overwrite it from there); the
# others fall back to an older step
DECISIVE = ("config", "bug", "unreadable")
MAX_MESSAGE = 1000  # characters of an unexpected exception's message that cross ranks (one line)


@dataclass(frozen=True)
class Failure:
    """An error on one rank (rank 0, usually), to be raised on all: `kind` is a key of KINDS."""

    kind: str
    message: str
    cause: BaseException | None = field(default=None, compare=False, repr=False)  # never crosses ranks

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """The kind of `exc` (a PermissionError: 'unreadable', by this user; anything else, e.g.
        another OSError, is a plain 'checkpoint' error)."""
        if isinstance(exc, PermissionError):
            return cls("unreadable", f"{exc.filename or 'a file of the step'} is {UNREADABLE} ({exc.strerror})")
        kind = next((k for k, c in KINDS.items() if isinstance(exc, c)), "checkpoint")
        return cls(kind, str(exc))

    @classmethod
    def on_rank(cls, exc: Exception, rank: int, world_size: int, doing: str) -> Failure:
        """Pure. What every rank learns of `exc`, raised on `rank` while `doing` ("planning its
        read of step 5"), keeping `exc` as the cause on this rank: a checkpoint problem
        (CheckpointError, OSError) as `of` says; a ConfigError prefixed with the rank when there
        are several; anything else a "bug" naming the rank, the exception's type and message."""
        if isinstance(exc, ConfigError):
            return cls("config", f"rank {rank}: {exc}" if world_size > 1 else str(exc), exc)
        if isinstance(exc, (SlurmResumeError, OSError)):
            known = cls.of(exc)
            return cls(known.kind, known.message, exc)
        text = " ".join(str(exc).split())
        text = text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "..."
        return cls("bug", f"rank {rank} failed while {doing}: {type(exc).__name__}: {text} (unexpected: a bug in "
                          f"slurmresume or in a state object's methods; the traceback is in rank {rank}'s log)", exc)

    @property
    def decisive(self) -> bool:
        """Every rank raises it now: no older step is tried."""
        return self.kind in DECISIVE

    def error(self, message: str | None = None) -> Exception:
        """The exception of this kind (with `message` instead of this one's, when given)."""
        return KINDS.get(self.kind, CheckpointError)(self.message if message is None else message)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "message": self.message}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Failure:
        return cls(str(d["kind"]), str(d["message"]))


# -- restoring ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RestoreChoice:
    """Rank 0 -> all: the checkpoint every rank loads now, O(1) on the wire whatever the world
    size: its step directory, the digest of the manifest rank 0 read there (pinned by the commit
    marker it checked), the saved world size and whether another one may load it, and `sharded`,
    the DTensor specs as `checkpoint.sharding.to_json` writes them (each tensor once where the
    placements give the pieces; listed pieces only for a mesh that does not span every rank).
    The manifest's bytes follow by a broadcast of their own (`restoreload.share_manifest`); each
    rank parses them, checked against `manifest_xxh3` (no second look at the marker);
    `manifest` holds that parse on the rank that has one and never crosses ranks."""

    step: int
    path: str
    world_size: int
    manifest_xxh3: str
    sharded: dict[str, Any] = field(default_factory=dict)
    elastic: bool = False
    manifest: Any = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "world_size": self.world_size,
                "manifest_xxh3": self.manifest_xxh3, "sharded": self.sharded, "elastic": self.elastic}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RestoreChoice:
        return cls(int(d["step"]), str(d["path"]), int(d["world_size"]), str(d["manifest_xxh3"]),
                   dict(d.get("sharded") or {}), bool(d.get("elastic")))


Pick = RestoreChoice | Failure | None  # rank 0's answer to "what do we load?" (None: nothing)


def pick_to_json(pick: Pick) -> dict[str, Any] | None:
    if pick is None:
        return None
    return {"choice": pick.to_json()} if isinstance(pick, RestoreChoice) else {"failure": pick.to_json()}


def pick_from_json(d: dict[str, Any] | None) -> Pick:
    if d is None:
        return None
    return RestoreChoice.from_json(d["choice"]) if "choice" in d else Failure.from_json(d["failure"])

"""Which memory snapshots a node keeps for the peer copy (issue #49 item 4, the lost node).

Why: a promotion after a node is lost (job/promote.py) needs one step that every surviving node
holds as its own snapshot AND of which the lost node's replica is held by its successor. Each
node's sender (job/peercopy.py) used to send its newest snapshot whenever it polled, and each
node kept only its newest own snapshot: by the time a node was lost its successor's own
snapshots were steps past the replica it held, and nothing was promoted (the bench, 5 of 5).

So the ranks agree, at each snapshot, on two steps, carried in the collective the snapshot
already makes (train/memtier.py `_checked`, `group.max_ints`), the same on every rank:
  - `target`: the step every node's sender copies to its successor now (the snapshot being
    written when it was chosen; each sender wakes on the pin file, not on a slow poll);
  - `keep`: the newest step whose replica every node's successor verified: each launcher's
    sender writes the receiver's "ok" to its node's ack file (`ACKED`), and the ranks take the
    minimum over nodes. Once that minimum reaches the target, the target becomes `keep` and the
    next snapshot the new target.
Each node's first rank writes both to its node's pin file (`PIN`) and keeps those two of its own
snapshots when it frees older ones (`memtier.prune`); each receiver keeps those two replicas of
its previous node (job/peercopy.py). Positive evidence only (DESIGN.md section 8): a step is
`keep` only after every node's receiver answered "ok" to its verified replica.

Bounded: a rank's node then holds at most four of its own snapshots (the one being written, the
newest committed, the target, keep), three while the copy keeps up with `snapshot_every` (the
target is the newest); the fit check (`memplan.refusal`) reads the tmpfs's and MemAvailable's
free bytes, so what these hold is counted as held. A target that a node lost (pruned, forgotten,
never committed there) or whose copy the receiver refused is dropped at the next snapshot and
the snapshot being written becomes the target: never a wait on a copy that cannot come.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .checkpoint.layout import MARKER, step_dir_name
from .contract import ENV_PEER_COPY_MBS, read_json, write_json

PIN = "peer-pin.json"  # in a node's memory root: {"target": step|None, "keep": step|None}
ACKED = "peer-acked.json"  # in a node's memory root, by its launcher: {"acked": step|None, "refused": step|None}
NONE = -1  # None in the collective's integers


@dataclass(frozen=True)
class Pins:
    target: int | None = None
    keep: int | None = None

    def held(self) -> set[int]:
        return {s for s in (self.target, self.keep) if s is not None}


def advance(pins: Pins, acked: int | None, lost: bool, refused: bool, step: int, keep_lost: bool = False) -> Pins:
    """Pure, every rank alike, at the snapshot of `step` (all inputs agreed across the ranks):
    `acked` the least step any node's successor verified, `lost` some node no longer holds the
    target, `refused` some node's successor refused it, `keep_lost` some node no longer holds
    `keep`. Returns the pins for this snapshot."""
    keep = None if keep_lost else pins.keep
    if pins.target is not None and not lost and not refused and acked is not None and acked >= pins.target:
        keep = pins.target  # every node's replica of the target verified: it is the promotable step
    elif pins.target is not None and not lost and not refused:
        return Pins(pins.target, keep)  # still being copied: kept as it is
    return Pins(step, keep)  # no target, its copy done, or one that cannot come: this snapshot is next


def peer_copy_on() -> bool:
    """Whether the launchers run a peer copy ($SLURMRESUME_PEER_COPY_MBS not "0" or less; a value
    that is not a number is their default rate, job/peercopy.py `rate_from_env`)."""
    raw = os.environ.get(ENV_PEER_COPY_MBS, "").strip()
    try:
        return not raw or float(raw) > 0
    except ValueError:
        return True


def encode(value: int | None) -> int:
    return NONE if value is None else value


def decode(value: int) -> int | None:
    return None if value < 0 else value


def read_pins(memory: Path) -> Pins:
    """A node's pin file (the ranks', read by its launcher and its ranks after a restart); none: no pins."""
    got = _read(memory / PIN)
    return Pins(_int(got.get("target")), _int(got.get("keep")))


def write_pins(memory: Path, pins: Pins) -> None:
    write_json(memory / PIN, {"target": pins.target, "keep": pins.keep})


def read_acked(memory: Path) -> tuple[int | None, int | None]:
    """(the newest step this node's successor verified, the newest it refused), from the ack file."""
    got = _read(memory / ACKED)
    return _int(got.get("acked")), _int(got.get("refused"))


def write_acked(memory: Path, acked: int | None, refused: int | None) -> None:
    write_json(memory / ACKED, {"acked": acked, "refused": refused})


def committed_here(memory: Path, step: int | None) -> bool:
    return step is not None and (memory / step_dir_name(step) / MARKER).exists()


def _read(path: Path) -> dict[str, object]:
    got = read_json(path)
    return got if isinstance(got, dict) else {}


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

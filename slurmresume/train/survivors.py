"""Who writes the failure-time save, decided purely from what every survivor can read on its node
(no message to or from the dead): `plan` over each rank's published step snapshots and each
survivor's status. DESIGN.md section 10; the shell that acts on the plan is `train.failsave`.

The rules:
- A step `s` is a candidate when some survivor's tensors are at `s`: its last `ckpt.step()` was
  `s` and no optimizer step ran on it since (`clean`).
- `s` is covered when every rank, the dead included, published its small state (RNG, plain
  values, per-rank tensors) at `s`, and the tensors that are not replicated are all among what
  the snapshots carry (`missing` names those that are not).
- A rank that died between its optimizer step and its `ckpt.step()` (after the step's gradient
  all-reduce, so the survivors went on to `s`) never published `s`; it is still covered by its
  *tail* snapshot (taken at that optimizer step, before it ran) when every piece that differs
  between a tail and its boundary on that rank (`tail_changed`, gathered over the whole run: the
  scheduler, the sampler's position, a value set after the step) is the same on every rank at the
  boundary before and at `s` (then a survivor's copy at `s` is the dead rank's), and nothing else
  changes: its RNG and per-rank values are those of its tail. The writer splices the two
  (`stepsnap.splice`). A published tensor piece that the optimizer step changed (an HSDP
  parameter small enough to publish) is taken instead from the memory of a replica peer clean at
  `s`, when the peers published the same bytes at `s` and the dead rank the same as they at the
  boundary before. A per-rank value set after the optimizer step (each rank's own loss) is not
  recoverable: the step is refused, naming it.
- A rank's tensors that are not replicated and too large to publish (`missing`: an FSDP2 or HSDP
  piece) are covered only by a survivor clean at `s` that holds the same bytes: the rank itself,
  or a replica peer, a rank at the same coordinate on every mesh dimension that shards the piece
  (HSDP's other replicas; `replica_dims`, learned once from the placements, as a restore reads a
  replicated piece from any one of them). FSDP2 has no peer: a dead rank's pieces are covered only
  by its own memory-tier snapshot of exactly `s`, verified by a survivor of its node, which then
  writes the shard (`memory`: dead rank -> (step, that survivor), train/memshard.py); else refused.
- The newest covered candidate wins; its committer (`writer`) is the lowest clean survivor at it,
  and writes every shard whose pieces are all in memory or published; a shard with pieces only a
  holder has is written by that holder (the rank itself when it is clean at `s`, else its lowest
  clean peer; `shards`), into the committer's directory, and the committer writes the marker
  after every shard reported. Nothing covered: refused, with every candidate's missing pieces
  named. Never two steps in one save.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

# A piece's replica layout: its mesh's shape and, per mesh dimension, whether every coordinate along
# it holds the same piece (Replicate, or a dimension of size 1).
ReplicaDims = tuple[tuple[int, ...], tuple[bool, ...]]


@dataclass(frozen=True)
class Status:
    """What one survivor reports once it has frozen: the step of its last `ckpt.step()` and
    whether its tensors are untouched since (no optimizer step ran after it)."""

    rank: int
    boundary: int | None
    clean: bool


@dataclass(frozen=True)
class Snapshot:
    """One rank's published small state at one step: `missing` names per-rank tensors that were
    too large to publish (then no failure save of that step can cover this rank)."""

    rank: int
    step: int
    missing: tuple[str, ...] = ()
    tail_of: int | None = None  # a tail snapshot: taken at the optimizer step after boundary `tail_of`
    digests: Mapping[str, str] = field(default_factory=dict)  # piece -> xxh3 of its bytes
    tail_changed: frozenset[str] = frozenset()  # pieces this rank ever changed after an optimizer step


@dataclass(frozen=True)
class Plan:
    """`step` and `writer` when a failure save can be committed; else `refused` says why."""

    step: int | None
    writer: int | None
    refused: tuple[str, ...] = field(default_factory=tuple)
    spliced: tuple[tuple[int, frozenset[str]], ...] = ()  # (rank, pieces from the writer's snapshot)
    shards: tuple[tuple[int, int], ...] = ()  # (rank, survivor that writes its shard), when not `writer`
    # (rank, tensors): a spliced rank's published pieces that changed at its optimizer step, taken from
    # its writer's memory (an HSDP replica peer's, at `step`) instead of its tail
    from_memory: tuple[tuple[int, frozenset[str]], ...] = ()
    from_snapshot: tuple[int, ...] = ()  # ranks whose unpublished pieces come from their memory-tier snapshot

    @property
    def ok(self) -> bool:
        return self.step is not None


def plan(world: int, dead: set[int], statuses: Mapping[int, Status],
         snapshots: Mapping[int, list[Snapshot]], *, replicated_known: bool = True,
         replicas: Mapping[str, ReplicaDims] | None = None, memory: Mapping[int, tuple[int, int]] | None = None) -> Plan:
    """Pure: the failure save to write (see the module docstring). `statuses`: the survivors that
    reported (a survivor that did not is simply no holder); `snapshots`: rank -> its published
    snapshots (at most the last two steps); `replicas`: `replica_dims` of the sharded pieces;
    `memory`: dead rank -> (step, survivor) offering its verified memory-tier shard of that step."""
    if not replicated_known:
        return Plan(None, None, ("which tensors are replicated is not known yet (no step() completed)",))
    if not dead:
        return Plan(None, None, ("no rank is dead",))
    holders: dict[int, list[int]] = {}
    dirty = []
    for st in statuses.values():
        if st.rank in dead or st.boundary is None:
            continue
        if st.clean:
            holders.setdefault(st.boundary, []).append(st.rank)
        else:
            dirty.append(f"rank {st.rank} ran an optimizer step after step {st.boundary}")
    reasons: list[str] = []
    for step in sorted(holders, reverse=True):
        got = _cover(world, step, snapshots, holders[step], replicas or {}, memory or {})
        if not got.missing:
            return Plan(step, min(holders[step]), spliced=tuple(sorted(got.spliced.items())),
                        shards=tuple(sorted(got.shards.items())), from_memory=tuple(sorted(got.from_memory.items())),
                        from_snapshot=tuple(got.from_snapshot))
        reasons.append(f"step {step}: {'; '.join(got.missing)}")
    if not holders:
        reasons.append("no survivor holds the tensors of a step boundary"
                       + (f" ({'; '.join(dirty)})" if dirty else ""))
    return Plan(None, None, tuple(reasons))


@dataclass
class _Cover:
    """What `_cover` found at one step (see `Plan`)."""

    missing: list[str] = field(default_factory=list)
    spliced: dict[int, frozenset[str]] = field(default_factory=dict)
    shards: dict[int, int] = field(default_factory=dict)
    from_memory: dict[int, frozenset[str]] = field(default_factory=dict)
    from_snapshot: list[int] = field(default_factory=list)


def _cover(world: int, step: int, snapshots: Mapping[int, list[Snapshot]], holders: list[int],
           replicas: Mapping[str, ReplicaDims], memory: Mapping[int, tuple[int, int]]) -> _Cover:
    """What no snapshot or clean holder covers at `step`, the ranks covered by their tail (with
    the pieces the writer's snapshot supplies, and the pieces a replica peer's memory does), and
    the shards a holder other than the committer writes (rank -> holder)."""
    got = _Cover()
    lead = min(holders)
    for rank in range(world):
        mine = snapshots.get(rank, ())
        snap = next((s for s in mine if s.step == step and s.tail_of is None), None)
        if snap is None:
            why, tail, pieces, peers = _by_tail(rank, step, snapshots, replicas)
            if tail is None:
                got.missing.append(why)
                continue
            snap, got.spliced[rank] = tail, pieces
            if peers:  # its published pieces changed at its optimizer step: a peer's memory has them at `step`
                snap = replace(tail, missing=(*tail.missing, *sorted(peers)))
                got.from_memory[rank] = peers
        if snap.missing:
            holder = _holder(rank, snap.missing, holders, replicas)
            offer = memory.get(rank)
            if holder is None and rank not in got.spliced and offer is not None and offer[0] == step \
                    and offer[1] in holders:  # its own memory-tier snapshot of exactly `step`, verified
                holder = offer[1]
                got.from_snapshot.append(rank)
            if holder is None:
                got.missing.append(f"rank {rank}'s per-rank tensors {', '.join(snap.missing[:4])}"
                                   + (f" and {len(snap.missing) - 4} more" if len(snap.missing) > 4 else "")
                                   + f" (not replicated, too large to publish, and on no clean survivor at step {step})")
            elif holder != lead:
                got.shards[rank] = holder
    return got


def _holder(rank: int, names: tuple[str, ...], holders: list[int], replicas: Mapping[str, ReplicaDims]) -> int | None:
    """Who writes `rank`'s shard with `names` from memory: the rank itself when it is a clean holder,
    else its lowest clean holder that is a replica peer for every name; None if none is."""
    if rank in holders:
        return rank
    layouts = {replicas.get(n) for n in names}
    if None in layouts:
        return None
    peers = set.intersection(*(set(peers_of(rank, d)) for d in layouts if d is not None))
    return min((h for h in holders if h in peers), default=None)


def replica_dims(specs: Mapping[str, Mapping[str, Any]], world: int) -> dict[str, ReplicaDims]:
    """Pure, learned once from a rank's DTensor specs (`dtensorspec.describe`): each piece's
    `ReplicaDims`, for DTensors on a mesh of every rank in order (`placement.arithmetic`: a rank's
    coordinate follows from its number); the others have no known peer and are not listed."""
    from ..checkpoint.placement import arithmetic

    out = {}
    for name, spec in specs.items():
        if arithmetic(spec, world):
            mesh = tuple(int(n) for n in spec["mesh_shape"])
            out[name] = (mesh, tuple(p == "replicate" or n == 1 for p, n in zip(spec["placements"], mesh)))
    return out


def coordinate(rank: int, mesh: tuple[int, ...]) -> tuple[int, ...]:
    """Pure: `rank`'s coordinate on a row-major mesh of ranks 0..prod(mesh)-1."""
    out = []
    for n in reversed(mesh):
        rank, c = divmod(rank, n)
        out.append(c)
    return tuple(reversed(out))


def peers_of(rank: int, dims: ReplicaDims) -> frozenset[int]:
    """Pure: the ranks that hold the same piece as `rank` (itself included): those at its
    coordinate on every mesh dimension that shards the piece."""
    mesh, same = dims
    coord = coordinate(rank, mesh)
    axes = [range(n) if s else (c,) for n, s, c in zip(mesh, same, coord)]
    strides = [math.prod(mesh[i + 1:]) for i in range(len(mesh))]
    return frozenset(sum(c * k for c, k in zip(cs, strides)) for cs in itertools.product(*axes))


def _by_tail(rank: int, step: int, snapshots: Mapping[int, list[Snapshot]], replicas: Mapping[str, ReplicaDims]
             ) -> tuple[str, Snapshot | None, frozenset[str], frozenset[str]]:
    """`rank`'s tail snapshot, the pieces to take from a survivor's `step`, and the tensors to take
    from a replica peer's memory at `step`; or why not."""
    mine = snapshots.get(rank, ())
    bounds = {s.step: s for s in mine if s.tail_of is None}
    why = f"rank {rank}'s RNG and plain values at step {step} (published: {sorted(bounds) or 'none'})"
    base = bounds.get(max(bounds)) if bounds else None
    tail = next((s for s in mine if s.tail_of is not None), None)
    if base is None or tail is None or tail.tail_of != base.step or base.step >= step:
        return why, None, frozenset(), frozenset()
    # `step` must be the boundary right after the tail's: a rank whose last two are exactly these
    if not any({s.step for s in snaps if s.tail_of is None} == {base.step, step} for snaps in snapshots.values()):
        return (why + f" (step {step} is not the boundary after its last optimizer step)", None, frozenset(),
                frozenset())
    at_step = [s for snaps in snapshots.values() for s in snaps if s.step == step and s.tail_of is None]
    new_keys = {p for s in at_step for p in s.digests} ^ set(tail.digests)
    pieces = frozenset(base.tail_changed | new_keys)
    at_base = [s for snaps in snapshots.values() for s in snaps if s.step == base.step and s.tail_of is None]
    differ = [p for p in sorted(pieces) if not (_same(p, at_step) and _same(p, at_base))]
    peers = {p for p in differ if _peer_piece(p, rank, step, base.step, snapshots, replicas)}
    differ = [p for p in differ if p not in peers]
    if differ:
        return (f"rank {rank}'s {', '.join(_piece_name(p) for p in differ[:4])} at step {step} "
                "(set after its optimizer step, and not the same on every rank)"), None, frozenset(), frozenset()
    return "", tail, pieces - peers, frozenset(p.partition(":")[2] for p in peers)


def _peer_piece(piece: str, rank: int, step: int, base: int, snapshots: Mapping[int, list[Snapshot]],
                replicas: Mapping[str, ReplicaDims]) -> bool:
    """Whether a published tensor piece of `rank` that changed after its tail is held by its replica
    peers: they published the same bytes at `step`, and the same as `rank` itself at `base`."""
    kind, _, name = piece.partition(":")
    if kind != "tensor" or name not in replicas:
        return False
    others = peers_of(rank, replicas[name]) - {rank}
    at_step = [s for q in others for s in snapshots.get(q, ()) if s.step == step and s.tail_of is None]
    at_base = [s for q in (*others, rank) for s in snapshots.get(q, ()) if s.step == base and s.tail_of is None]
    return _same(piece, at_step) and _same(piece, at_base)


def _same(piece: str, snaps: list[Snapshot]) -> bool:
    """The piece has one digest on every one of `snaps` (at least one)."""
    values = {s.digests.get(piece) for s in snaps}
    return bool(snaps) and len(values) == 1 and None not in values


def _piece_name(piece: str) -> str:
    kind, _, name = piece.partition(":")
    return {"entry": f"value '{name}'", "tensor": f"tensor {name}"}.get(kind, "RNG")

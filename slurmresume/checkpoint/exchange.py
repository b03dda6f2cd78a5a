"""A resharding restore that opens each saved shard once: its owner reads it and sends every
other rank the pieces it needs, instead of every rank opening every shard its boxes span.

Why: torch chunks each tensor by ceil(rows / W), so at a reshard different tensors give a rank's
boxes different saved ranks (16,384 -> 12,288 ranks: a 405B rank's boxes span ~5 saved shards,
~6 opens a rank against one metadata server, 6 x W a restore). Here saved shard s is opened by one
rank, its owner: the restoring rank that needs the most of its bytes (ties: the lowest), so the
largest share of every shard never crosses the network. A restore opens at most W' + W shard
files (each rank its own shard's header, W' of them, and each saved shard once).

The price: the bytes cross the side group (gloo, CPU) instead of the file system, and an owner
holds one requester's message at a time besides its own boxes (1 GiB, 4 -> 3 ranks on one 2-core
host: 1.5x the direct restore's time). So it is chosen (`wanted`, `worth_it`) only where it pays:
onto EXCHANGE_MIN_RANKS ranks or more, when the ranks reading their own boxes would open over
FANOUT shard files each (one SUM over the ranks), or forced either way by
SLURMRESUME_RESHARD_EXCHANGE; every rank must agree (`restoreload.load_choice`), else every rank
reads its own boxes (`reshard.load_sharded`).

Protocol (every rank, once every rank planned and agreed on the same inputs, `Plan.digest`):
1. `plan` (pure arithmetic on the placements, no file opened): for each owner, the chunks
   (tensor, global offset, shape) this rank receives from it; for each requester of a shard this
   rank owns, the chunks it sends; both sides use `sharding.cover` on the requester's box, ordered
   by tensor name then saved rank, so a message's layout is known to both without being sent.
2. `load`: every rank posts its receives first (sizes known), then, requester by requester, reads
   and verifies the chunks (`reshard.read_box`: every byte checked against the header digests, as
   a direct read would) and sends one message [chunks, 16-byte aligned][status byte]. A read that
   fails sends status 1 and the message's size of zeros (the receive is posted for that size) and
   the error is raised after every message went: no rank ever waits for a message never sent.
   "verify" mode (the first pass of a restore too large to stage) sends nothing: each owner
   verifies what it would send.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from ..errors import ConfigError, PeerReadError
from .boxes import Target, placement_kinds
from .placement import local_box, pieces_at
from .reshard import ShardFiles, box_dest, box_value, empty_box, read_box
from .shard import ITEMSIZE, TORCH_DTYPES
from .sharding import Sharded, cover

ENV_RESHARD_EXCHANGE = "SLURMRESUME_RESHARD_EXCHANGE"  # "1" / "0" force / forbid; unset or "auto"
EXCHANGE_MIN_RANKS = 64  # auto: from this many restoring ranks on (resharding) ...
FANOUT = 3  # ... when reading their own boxes would open over this many shard files a rank
ALIGN = 16
Chunk = tuple[str, tuple[int, ...], tuple[int, ...]]  # tensor name, global offset, shape


def wanted(setting: str | None, world: int) -> str:
    """Pure: this rank's answer for a resharding restore onto `world` ranks: "on" (forced by
    SLURMRESUME_RESHARD_EXCHANGE=1), "off" (=0, or fewer than EXCHANGE_MIN_RANKS ranks), or "auto"
    (unset or "auto", from EXCHANGE_MIN_RANKS ranks on): then `worth_it` decides from every rank's
    count of the shards it would open reading its own boxes."""
    value = (setting or "auto").strip().lower()
    if value not in ("auto", "0", "1"):
        raise ConfigError(f"{ENV_RESHARD_EXCHANGE}={setting!r}: give 1 (each saved shard read by one rank and sent), "
                          f"0 (every rank reads its own boxes) or auto (from {EXCHANGE_MIN_RANKS} ranks on, when the "
                          f"ranks would open over {FANOUT} shards each on average)")
    if value == "1":
        return "on"
    return "auto" if value == "auto" and world >= EXCHANGE_MIN_RANKS else "off"


def worth_it(direct_opens: int, world: int) -> bool:
    """Pure ("auto"): the exchange where reading their own boxes would have the `world` ranks open
    `direct_opens` shard files in all, over FANOUT a rank: there it saves the metadata server
    most (and keeps a restore under 4 x W operations), and elsewhere the bytes need not cross
    the network (here, 1 GiB 4 -> 3 ranks on one host: 1.5x the direct restore's time)."""
    return direct_opens > FANOUT * world


@dataclass
class Plan:
    """One rank's part of the exchange (see the module docstring). `digest`: of every input the
    plans of all ranks must share (tensors, saved layouts, target meshes and placements)."""

    rank: int
    world: int
    digest: int
    recv: dict[int, list[Chunk]] = field(default_factory=dict)  # owner -> chunks, in message order
    send: dict[int, list[Chunk]] = field(default_factory=dict)  # requester -> chunks, in message order
    local: list[Chunk] = field(default_factory=list)  # chunks of shards this rank owns, for itself
    owned: list[int] = field(default_factory=list)  # the saved shards this rank opens for the others
    dtypes: dict[str, str] = field(default_factory=dict)
    forced: bool = False  # SLURMRESUME_RESHARD_EXCHANGE=1 on this rank (`wanted` "on"): no `worth_it`

    @property
    def peak_bytes(self) -> int:
        """Memory the exchange holds beyond the boxes: every message received, the largest sent."""
        return sum(message_bytes(c, self.dtypes) for c in self.recv.values()) + max(
            (message_bytes(c, self.dtypes) for c in self.send.values()), default=0)


def message_bytes(chunks: Sequence[Chunk], dtypes: Mapping[str, str]) -> int:
    return _offsets(chunks, dtypes)[-1] + 1


def _offsets(chunks: Sequence[Chunk], dtypes: Mapping[str, str]) -> list[int]:
    """Byte offset of each chunk in its message, then of the status byte."""
    out, pos = [], 0
    for name, _, shape in chunks:
        out.append(pos)
        pos += -(-math.prod(shape) * ITEMSIZE[dtypes[name]] // ALIGN) * ALIGN
    out.append(pos)
    return out


def plan(rank: int, world: int, saved_world: int, index: Mapping[str, Sharded], where: Mapping[str, Target],
         boxes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> Plan | None:
    """Pure (every rank, after its restore plan): this rank's exchange, or None when the specs do
    not allow one (a tensor whose saved pieces are listed, not placed by arithmetic; a target that
    is not a Shard/Replicate DTensor on a mesh over every rank). Raises CorruptCheckpointError
    where the saved pieces do not cover a box (as a direct read would)."""
    meshes: dict[int, tuple[Any, ...]] = {}
    ranks_of: dict[str, Any] = {}  # a mesh's digest -> its ranks (nested lists, indexed by coordinate)
    facts = []
    for name in sorted(where):
        tensor, target = index[name], where[name]
        if tensor.layout is None or target.mesh is None:
            return None
        kinds = placement_kinds(tuple(target.placements))
        mesh = meshes.get(id(target.mesh))
        if mesh is None:
            ranks = target.mesh.mesh.tolist()
            flat = target.mesh.mesh.flatten().tolist()
            if sorted(flat) != list(range(world)):
                return None
            mesh = meshes[id(target.mesh)] = (tuple(target.mesh.shape), xxhash.xxh3_64_hexdigest(repr(flat).encode()))
            ranks_of[mesh[1]] = ranks
        if kinds is None:
            return None
        facts.append((name, (tensor.shape, tensor.dtype, tensor.layout, mesh[0], kinds, mesh[1])))
    out = Plan(rank, world, xxhash.xxh3_64_intdigest(repr(facts).encode()) >> 2, dtypes={n: k[1] for n, k in facts})
    # Tensors of one global shape, dtype, saved layout and target share their boxes and chunks:
    # a model's layers repeat a few (405B: 3,411 DTensors a rank, 5 groups); worked out once each.
    groups: dict[tuple[Any, ...], list[str]] = {}
    for name, key in facts:
        groups.setdefault(key, []).append(name)
    hits: dict[tuple[Any, ...], list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    for key, names in groups.items():
        box_shape, box_offset = boxes[names[0]]
        hits[key] = sorted((p.rank, tuple(lo), tuple(b)) for p, lo, b in
                           cover(index[names[0]], tuple(box_offset), tuple(box_shape)))
    needs: dict[tuple[tuple[Any, ...], int], list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = {}
    owners: dict[int, int] = {}
    for saved in sorted({s for h in hits.values() for s, _, _ in h}):
        taken: dict[int, int] = {}
        for key, names in groups.items():
            needs[(key, saved)] = chunks = _requesters(index[names[0]], saved, key[3], ranks_of[key[5]], key[4])
            for q, _, b in chunks:
                taken[q] = taken.get(q, 0) + len(names) * math.prod(b) * ITEMSIZE[key[1]]
        owners[saved] = min(taken, key=lambda q: (-taken[q], q))
    out.owned = sorted(s for s, o in owners.items() if o == rank)
    for name, key in facts:
        for saved, lo, b in hits[key]:
            held_by = owners[saved]
            (out.local if held_by == rank else out.recv.setdefault(held_by, [])).append((name, lo, b))
        for saved in out.owned:
            for q, lo, b in needs[(key, saved)]:
                if q != rank:
                    out.send.setdefault(q, []).append((name, lo, b))
    return out


def _requesters(tensor: Sharded, saved: int, mesh_shape: tuple[int, ...], ranks: Any, kinds: tuple[str, ...]
                ) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """The restoring ranks whose boxes of `tensor` take bytes of saved shard `saved`, each with
    its chunk: the new ranks whose boxes meet the saved piece, checked by the same `cover` the
    requester runs (the piece's lowest holder is the one read)."""
    assert tensor.layout is not None
    old_mesh, old_kinds = tuple(tensor.layout[0]), tuple(tensor.layout[1])
    coord, rest = [], saved
    for n in reversed(old_mesh):
        coord.append(rest % n)
        rest //= n
    offset, shape = local_box(tuple(tensor.shape), old_mesh, tuple(reversed(coord)), old_kinds)
    if not math.prod(shape):
        return []
    out = []
    for coords, lo, ext in pieces_at(tuple(tensor.shape), mesh_shape, kinds, offset, shape, every_replica=True):
        q = ranks
        for c in coords:
            q = q[c]
        for piece, a, b in cover(tensor, lo, ext):
            if piece.rank == saved:
                out.append((int(q), tuple(a), tuple(b)))
    return out


def load(group: Any, plan_: Plan, directory: Path, shards: Sequence[dict[str, Any]], index: Mapping[str, Sharded],
         where: Mapping[str, Target], expect: Callable[[int], Any] | None, mode: str, opened: Any,
         boxes: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> dict[str, Any]:
    """Collective (every rank of `group` whose plans agreed): `reshard.load_sharded`'s result, each
    saved shard read by its owner only. Raises (CheckpointError) only once every message of this
    rank went and every message to it arrived."""
    import torch
    import torch.distributed as dist

    dests: dict[str, tuple[Any, Any]] = {}  # name -> reshard.box_dest: (box memory, live tensor or None)
    errors: list[BaseException] = []  # this rank's own reads
    peers: list[BaseException] = []  # a message whose owner could not read it
    try:
        for name in where if mode != "verify" else ():
            dests[name] = box_dest(where[name], index[name], tuple(boxes[name][0]), mode)
    except Exception as exc:  # noqa: BLE001 - (out of memory) this rank still serves and receives
        errors.append(exc)
        dests = {}
    comm = mode != "verify" and group.world_size > 1  # verify: each owner checks what it would send
    inbox = {o: torch.empty(message_bytes(c, plan_.dtypes), dtype=torch.uint8)
             for o, c in sorted(plan_.recv.items())} if comm else {}
    waits: list[Any] = [dist.irecv(buf, group=group.pg, group_src=o) for o, buf in inbox.items()]
    files = ShardFiles(directory, shards, expect, opened)
    try:
        try:
            for name, lo, shape in plan_.local:
                _read_chunk(files, index[name], boxes[name], lo, shape, dests[name][0] if name in dests else None)
        except Exception as exc:  # noqa: BLE001 - raised once every message went
            errors.append(exc)
        sending: Any = None  # the message in flight (one at a time: an owner holds one)
        for q, chunks in sorted(plan_.send.items()):
            msg = _message(files, index, chunks, plan_.dtypes, errors)
            if comm:
                if sending is not None:
                    sending.wait()
                sending = dist.isend(msg, group=group.pg, group_dst=q)
        if sending is not None:
            sending.wait()
    finally:
        files.close()
    for w in waits:
        w.wait()
    for o, buf in inbox.items() if not errors else ():  # (this rank's own error is raised)
        chunks = plan_.recv[o]
        offsets = _offsets(chunks, plan_.dtypes)
        if int(buf[offsets[-1]]) != 0:
            peers.append(PeerReadError(
                f"rank {o} could not read the saved pieces this rank needs (its own error says why)"))
            continue
        for (name, lo, shape), at in zip(chunks, offsets):
            nbytes = math.prod(shape) * ITEMSIZE[plan_.dtypes[name]]
            src = buf[at:at + nbytes].view(TORCH_DTYPES[plan_.dtypes[name]]).view(shape)
            _region(dests[name][0], boxes[name], lo, shape).copy_(src)
    if errors or peers:
        raise (errors or peers)[0]
    return {name: box_value(dest, local, where[name], index[name]) for name, (dest, local) in dests.items()}


def _region(dest: Any, box: tuple[tuple[int, ...], tuple[int, ...]], lo: tuple[int, ...], shape: tuple[int, ...]) -> Any:
    """The part of this rank's box `dest` (box = (shape, global offset)) at global `lo`, `shape`."""
    return dest[tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, box[1], shape))]


def _read_chunk(files: ShardFiles, tensor: Sharded, box: tuple[tuple[int, ...], tuple[int, ...]],
                lo: tuple[int, ...], shape: tuple[int, ...], dest: Any) -> None:
    """One chunk of this rank's own box, read and verified into `dest` (None: verify only)."""
    region = _region(dest, box, lo, shape) if dest is not None else empty_box(shape, tensor.dtype)
    read_box(files, tensor, lo, shape, region)


def _message(files: ShardFiles, index: Mapping[str, Sharded], chunks: Sequence[Chunk], dtypes: Mapping[str, str],
             errors: list[BaseException]) -> Any:
    """One requester's message: its chunks read and verified, status 0; status 1 (and zeros) when
    a read failed (the error appended to `errors`)."""
    import torch

    offsets = _offsets(chunks, dtypes)
    msg = torch.zeros(offsets[-1] + 1, dtype=torch.uint8)
    try:
        for (name, lo, shape), at in zip(chunks, offsets):
            nbytes = math.prod(shape) * ITEMSIZE[dtypes[name]]
            view = msg[at:at + nbytes].view(TORCH_DTYPES[dtypes[name]]).view(shape)
            read_box(files, index[name], lo, shape, view)
    except Exception as exc:  # noqa: BLE001 - sent as status 1, raised once every message went
        errors.append(exc)
        msg.zero_()
        msg[offsets[-1]] = 1
    return msg


def setting() -> str | None:
    """The environment's SLURMRESUME_RESHARD_EXCHANGE (None: unset)."""
    return os.environ.get(ENV_RESHARD_EXCHANGE)

"""Rank coordination for saves and restores, over CPU/gloo side groups (never the training group).

Works without torch.distributed: a world of one. JSON (and a chosen manifest's own bytes) travels as
uint8 tensors, never pickles.
All methods are collective: every rank calls them in the same order.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections.abc import Mapping
from typing import Any

LAZY = "TORCH_GLOO_LAZY_INIT"  # read by ProcessGroupGloo when a group is created


# Side groups of up to this many ranks are made eagerly (see `new_side_group`); larger ones
# lazily. Measured (2026-12-05, 4 ranks): an eager group holds W sockets per rank (W - 1 pairs
# and a listener), so our two groups hold ~2 W: 264 at 128 ranks, a quarter of a default limit
# of 1,024 open files. The same number on every rank (a group is lazy on all its ranks or none).
EAGER_MAX_RANKS = 128


def lazy_init_value(size: int, user_value: str | None) -> str:
    """TORCH_GLOO_LAZY_INIT for making a side group of `size` ranks. Up to EAGER_MAX_RANKS: "0",
    whatever the user set (see `new_side_group`). Beyond: the user's value if set, else "1": a
    full mesh would open W sockets per rank and group at creation (past a default 1,024 open
    files from ~500 ranks, W^2 / 2 connections per group at 16,384), while gather, broadcast and
    MAX connect a few pairs per rank."""
    if size <= EAGER_MAX_RANKS:
        return "0"
    return user_value if user_value is not None else "1"


def new_side_group(ranks: list[int] | None = None, **kwargs: Any) -> Any:
    """Collective (`dist.new_group` over `ranks`, default all): a gloo group, made eagerly (every
    pair connected at creation) up to EAGER_MAX_RANKS ranks, lazily beyond (`lazy_init_value`);
    the caller's TORCH_GLOO_LAZY_INIT is back afterwards. Eagerly where it is affordable: a lazy
    gloo group's teardown stops its event loop before it frees its pairs, so a peer's close read
    in the loop's last ticks closes the pair without taking its socket out of epoll; when a forked
    child (a DataLoader's persistent worker) still holds a copy of that socket, epoll reports it
    again and gloo aborts the process (`pair.cc:676 state_ <= CONNECTED. 5 vs 4`, SIGABRT), after
    the run's final save. An eager group takes each socket out of epoll before it closes it.
    Beyond EAGER_MAX_RANKS that abort can still happen (docs/troubleshooting.md)."""
    import torch.distributed as dist

    size = len(ranks) if ranks is not None else dist.get_world_size()
    before = os.environ.get(LAZY)
    os.environ[LAZY] = lazy_init_value(size, before)
    try:
        return dist.new_group(ranks, backend="gloo", **kwargs)
    finally:
        if before is None:
            os.environ.pop(LAZY, None)
        else:
            os.environ[LAZY] = before


def unjoined_world(env: Mapping[str, str]) -> str | None:
    """Pure: why a process without a default process group must not act as a world of one, or
    None. torchrun (and srun through it) starts WORLD_SIZE processes; a script that never calls
    init_process_group makes each a world of one, and all of them save into one root, each
    replacing the others' steps."""
    size = env.get("WORLD_SIZE", "").strip()
    if not size.isdigit() or int(size) <= 1:
        return None
    rank = env.get("RANK", "").strip() or "?"
    return (f"WORLD_SIZE={size} (this is RANK={rank}) but torch.distributed has no process group: call "
            f"torch.distributed.init_process_group() before creating the Checkpointer (else each of the {size} "
            "processes saves alone into the same root, replacing the others' steps)")


class Group:
    """A process group (or a single process) with the few collectives the protocol needs."""

    def __init__(self, pg: Any = None, rank: int = 0, world_size: int = 1) -> None:
        self.pg = pg
        self.rank = rank
        self.world_size = world_size
        self.node_pg: Any = None

    @classmethod
    def create(cls) -> Group:
        """Collective when torch.distributed is initialised: every rank must call it. Without a
        process group, a world of one, unless the environment says there are more processes
        (`unjoined_world`): ConfigError, before anything is read or written."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            problem = unjoined_world(os.environ)
            if problem:
                from ..errors import ConfigError

                raise ConfigError(problem)
            return cls()
        pg = new_side_group()  # eager up to EAGER_MAX_RANKS, lazy beyond: see new_side_group
        return cls(pg, dist.get_rank(), dist.get_world_size())

    @property
    def is_coordinator(self) -> bool:
        return self.rank == 0

    def all_gather_json(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        import torch
        import torch.distributed as dist

        raw = json.dumps(obj, separators=(",", ":")).encode()
        size = torch.tensor([len(raw)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.pg)
        longest = int(max(s.item() for s in sizes))
        buf = torch.zeros(longest, dtype=torch.uint8)
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else buf[:0]
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(bufs, buf, group=self.pg)
        return [json.loads(bytes(b[: int(s.item())].numpy())) for b, s in zip(bufs, sizes)]

    def broadcast_json(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (other ranks' argument is ignored): its length, then its
        bytes, by broadcast. Each rank receives the one payload, never W of them."""
        if self.world_size == 1:
            return obj
        return json.loads(self.broadcast_bytes(_encode(obj) if self.rank == 0 else b""))

    def broadcast_bytes(self, raw: bytes) -> bytes:
        """Rank 0's `raw` on every rank (other ranks' argument is ignored; a world of one gets its
        own back): its length, then, unless empty, its bytes, by broadcast. Each rank receives the
        one payload, never W of them; rank 0 gets its own object back (no copy)."""
        if self.world_size == 1:
            return raw
        import torch
        import torch.distributed as dist

        size = torch.tensor([len(raw) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(size, group=self.pg, group_src=0)
        n = int(size.item())
        if n == 0:  # every rank knows it is empty: no second broadcast on any
            return raw if self.rank == 0 else b""
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, group=self.pg, group_src=0)
        return raw if self.rank == 0 else bytes(buf.numpy())

    def gather_json(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` on rank 0 (in rank order); None on the others. The longest record's
        length is agreed first (one MAX), then each rank sends rank 0 its record, padded to it:
        a rank other than 0 receives 8 bytes."""
        if self.world_size == 1:
            return [obj]
        import torch
        import torch.distributed as dist

        raw = _encode(obj)
        longest = self.max_ints([len(raw)])[0]
        buf = _buffer(raw + b" " * (longest - len(raw)), longest)
        bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(buf, bufs, group=self.pg, group_dst=0)
        return [json.loads(bytes(b.numpy())) for b in bufs] if bufs is not None else None

    def max_int(self, value: int) -> int:
        return self.max_ints([value])[0]

    def max_ints(self, values: list[int]) -> list[int]:
        """Element-wise MAX over ranks (every rank passes as many values). MIN is -MAX(-x)."""
        return self._all_reduce(values, "MAX")

    def sum_int(self, value: int) -> int:
        """SUM over ranks (collective)."""
        return self._all_reduce([value], "SUM")[0]

    def _all_reduce(self, values: list[int], op: str) -> list[int]:
        if self.world_size == 1:
            return list(values)
        import torch
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.int64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self.pg)
        return [int(v) for v in t.tolist()]

    def destroy(self) -> None:
        """Release this side group's gloo resources (threads that would otherwise be torn down
        at interpreter exit). Idempotent; a no-op for a world of one."""
        if self.pg is None:
            return
        pg, self.pg = self.pg, None
        node, self.node_pg = self.node_pg, None  # the per-node layout's subgroup (nodefile), if any
        self.world_size, self.rank = 1, 0  # any later collective is a local no-op
        if node is not None:
            NODE_GROUPS.give_back(node)  # kept for the next Group: see NodeGroups
        _destroy(pg)

    def barrier(self) -> None:
        if self.world_size > 1:
            self.max_int(0)


def _destroy(pg: Any) -> None:
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group(pg)
    except (RuntimeError, ValueError):  # already gone with the default group
        pass


class NodeGroups:
    """The per-node layout's node subgroups (`nodefile.GlooLink`), one process's: a Group's
    subgroup outlives it, idle, and the next Group of this process takes it instead of making a
    new one; the idle ones are destroyed at exit (or go with the default group). Never destroyed
    and made again because torch names a `use_local_synchronization` group by a hash of its ranks
    and the number of live groups: a new group of the same ranks got the destroyed one's name, its
    gloo rendezvous read the destroyed group's addresses from the store under that name, and some
    ranks failed with "Connection refused" while the node's others waited for them until the job
    ended. Every rank of a node takes and gives back in the same order (when a Checkpointer is
    made, in the main thread; when it closes), so they take the same group; Groups open at once
    hold distinct ones."""

    def __init__(self) -> None:
        self.idle: dict[tuple[int, ...], list[Any]] = {}
        self.lock = threading.Lock()
        self.exiting = False

    def take(self, ranks: list[int]) -> Any:
        """An idle subgroup of exactly `ranks`, or a new one (collective among `ranks` only)."""
        with self.lock:
            idle = self.idle.get(tuple(ranks), [])
            while idle:
                pg = idle.pop()
                if _ranks_of(pg) is not None:  # not gone with an earlier default group
                    return pg
        return new_side_group(ranks, use_local_synchronization=True)

    def give_back(self, pg: Any) -> None:
        ranks = _ranks_of(pg)
        with self.lock:
            if ranks is not None and not self.exiting:
                self.idle.setdefault(tuple(ranks), []).append(pg)
                return
        if ranks is not None:
            _destroy(pg)

    def drain(self) -> None:
        """At exit (local): the idle groups destroyed, and any given back later."""
        with self.lock:
            self.exiting = True
            idle, self.idle = [pg for pgs in self.idle.values() for pg in pgs], {}
        for pg in idle:
            _destroy(pg)


def _ranks_of(pg: Any) -> list[int] | None:
    """A live group's global ranks; None once it is destroyed (with its default group)."""
    import torch.distributed as dist

    try:
        return dist.get_process_group_ranks(pg) if dist.is_initialized() else None
    except (KeyError, RuntimeError, ValueError):
        return None


NODE_GROUPS = NodeGroups()
atexit.register(NODE_GROUPS.drain)


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _buffer(raw: bytes, size: int) -> Any:
    """A uint8 tensor of `size` bytes holding `raw` (zeros when `raw` is empty: a receiver's)."""
    import torch

    buf = torch.zeros(size, dtype=torch.uint8)
    if raw:
        buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


class LaggedMax:
    """The per-step agreement, pipelined: each call posts this rank's value as an asynchronous
    MAX all-reduce and returns the result of the one posted by the previous call. The round trip
    (a few hundred µs on gloo) thus overlaps a training step instead of stalling it; every rank
    still acts on the same reduction, hence at the same step, one step after the signal.
    Collective: every rank calls `exchange` once per step, and `drain` at the end."""

    def __init__(self, group: Group) -> None:
        self.group = group
        self._work: Any = None
        self._buf: Any = None

    def exchange(self, value: int) -> int:
        if self.group.world_size == 1:
            return value
        import torch
        import torch.distributed as dist

        result = self.drain()
        if result:
            return result  # everyone acts now; nothing new is posted
        self._buf = torch.tensor([value], dtype=torch.int64)
        self._work = dist.all_reduce(self._buf, op=dist.ReduceOp.MAX, group=self.group.pg, async_op=True)
        return 0

    def drain(self) -> int:
        """Wait for the posted reduction (if any) and return its result."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._buf.item())

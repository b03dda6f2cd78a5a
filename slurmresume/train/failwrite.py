"""The writers of a failure-time save (DESIGN.md section 10): `train.failsave` decides when, the pure
`survivors.plan` decides the step and who writes which shard; this module writes them, from one
survivor's frozen state at that step and the snapshots every rank published.

- The committer (`Plan.writer`, the lowest clean survivor) writes every shard it can: the
  replicated tensors from its memory, each rank's per-rank state from that rank's snapshot (or its
  tail spliced with the committer's snapshot), and the pieces it holds itself.
- A shard with pieces that were too large to publish (FSDP2/HSDP) is written by a survivor that
  holds them in memory at the step (`Plan.shards`): the rank itself, or an HSDP replica peer (the
  same piece on the other replica: `Layout.replicas`). One process cannot read another's memory,
  so each holder writes those shards itself, into the committer's private directory, as the ranks
  of a normal save do (`checkpoint.commit.write_rank`).
- They agree by files in the node-local failsave directory, never by a collective: the committer
  runs `prepare` and announces its decision (`save-<step>.json`: the directory and who writes
  which shard, or why nothing is written); each holder writes its shards there and a report per
  shard (`report-<step>-<rank>.json`); the committer commits (manifest, then the marker, last)
  only once every shard reported without error. A holder that dies or stays silent for
  WRITE_WAIT_S leaves the directory uncommitted (discarded): the newest committed step stands.
- FSDP2 (no replica peer): a dead rank's unpublished pieces come from its own memory-tier snapshot of
  exactly the step, read and verified beforehand by the survivor of its node that the plan makes its
  writer (`snapshot_pieces`, `Plan.from_snapshot`, train/memshard.py).
- Never two steps in one save: every writer is a survivor clean at the step (no optimizer step
  since its `ckpt.step()`, and frozen: none can start), and checks it again before writing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from ..checkpoint import commit as _commit
from ..checkpoint.layout import shard_name
from ..checkpoint.placement import arithmetic, local_box
from ..checkpoint.reports import SaveOutcome, WriteReport
from ..checkpoint.state import flatten, referenced
from ..contract import read_json, write_json
from . import failgpu, stepsnap
from .survivors import Plan, ReplicaDims, coordinate, peers_of

WRITE_WAIT_S = 20.0  # how long the committer waits for the other writers' shards, and they for its decision


@dataclass(frozen=True)
class Seat:
    """Rank and world of a shard written on another rank's behalf (what `write_rank` reads)."""

    rank: int
    world_size: int


@dataclass
class Writer:
    """One survivor, frozen at its last boundary: what it holds and where the survivors meet."""

    dir: Path  # the node-local failsave directory (snapshots, statuses, decisions, reports)
    root: Path
    rank: int
    world: int
    state: Mapping[str, Any] | None
    layout: stepsnap.Layout | None
    boundary: int | None
    clean: bool
    dead_now: Callable[[], set[int]]
    pg: Any = None  # the process group whose NCCL communicator a GPU save aborts (train/failgpu.py)
    # dead rank -> its tensors at the step, read and verified from its memory-tier snapshot by this
    # survivor of its node (train/memshard.py); used only for the ranks the plan says (`from_snapshot`)
    snapshot_pieces: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)

    def commit(self, p: Plan) -> SaveOutcome | None:
        """The committer: the shards it writes, its private directory announced to the other
        writers, their reports, then the commit; returns commit's outcome, or None when the step
        is committed already (a periodic save of it won the race: nothing written)."""
        from ..checkpoint.nodefile import layout_from_env

        assert p.step is not None
        step, others = p.step, dict(p.shards)
        if layout_from_env() != "per-rank":
            return self._refuse(step, "the per-node shard layout is not written by a failure save yet")
        try:
            first = self._snap(step, 0, p)  # its metrics and meta go into the manifest
            shards = self._shards(step, [r for r in range(self.world) if r not in others], p)
        except Uncovered as exc:
            return self._refuse(step, str(exc))
        decision = _commit.prepare(self.root, step)
        if decision.action == "skip":
            self._announce(step, {"action": "skip"})
            return None
        if decision.action != "write":
            return self._refuse(step, decision.error)
        self._announce(step, {"action": "write", "dir": decision.dir, **_plan_json(p)})
        reports = {r: self._write_shard(step, r, skeleton, tensors, decision.dir) for r, skeleton, tensors in shards}
        reports.update(self._reports(step, others))
        return _commit.commit(self.root, step, [reports[r] for r in range(self.world)], first["metrics"],
                              first["meta"], into=decision.dir)

    def help(self, p: Plan) -> str | None:
        """A holder of pieces the committer lacks: once the committer announced its directory,
        write the shards it assigned to this rank into it and report each. Returns why nothing
        was written, or None."""
        assert p.step is not None and p.writer is not None
        step = p.step
        announced = self._announced(step, p.writer)
        if announced is None:
            return f"the committer (rank {p.writer}) did not announce a directory"
        if announced.get("action") != "write":
            return str(announced.get("error") or announced.get("action"))
        try:
            p = _plan_from(announced, step, p.writer)  # the committer's: what it expects from this rank
        except (TypeError, ValueError, AttributeError) as exc:
            return f"the committer's announcement is malformed ({exc})"
        mine = sorted(r for r, w in p.shards if w == self.rank)
        try:
            if self.boundary != step or not self.clean:
                raise Uncovered(f"rank {self.rank} does not hold step {step}")
            shards = self._shards(step, mine, p)
        except Uncovered as exc:
            for r in mine:
                write_json(self.dir / f"report-{step}-{r}.json", self._failed(r, str(exc)).to_json())
            return str(exc)
        for r, skeleton, tensors in shards:  # the report turns into JSON here, at the file, and back in _reports
            write_json(self.dir / f"report-{step}-{r}.json",
                       self._write_shard(step, r, skeleton, tensors, announced["dir"]).to_json())
        return None

    # -- agreeing by files ------------------------------------------------------------------------

    def _refuse(self, step: int, error: str) -> SaveOutcome:
        self._announce(step, {"action": "error", "error": error})  # the other writers stop waiting
        return SaveOutcome(False, error=error)

    def _failed(self, rank: int, error: str) -> WriteReport:
        """The report of `rank`'s shard that was not written (the commit stops on it)."""
        return WriteReport(rank, shard_name(rank, self.world), error=error)

    def _announce(self, step: int, decision: dict[str, Any]) -> None:
        write_json(self.dir / f"save-{step}.json", decision)

    def _announced(self, step: int, writer: int) -> dict[str, Any] | None:
        """The committer's decision for `step`; None when it died or stayed silent (WRITE_WAIT_S)."""
        deadline = time.monotonic() + WRITE_WAIT_S
        while True:
            gone = writer in self.dead_now()  # before the read: a committer that announced, then died, is read
            got = read_json(self.dir / f"save-{step}.json")
            if isinstance(got, dict):
                return got
            if gone or time.monotonic() > deadline:
                return None
            time.sleep(0.02)

    def _reports(self, step: int, others: Mapping[int, int]) -> dict[int, WriteReport]:
        """The other writers' reports (rank -> report); a writer that died or stayed silent
        (WRITE_WAIT_S) leaves an error report for each of its shards, and so does a report file
        that is not one: nothing is committed."""
        deadline = time.monotonic() + WRITE_WAIT_S
        out: dict[int, WriteReport] = {}
        while True:
            gone = self.dead_now()  # before the reads: a writer reports, then exits
            for r in others:
                got = read_json(self.dir / f"report-{step}-{r}.json") if r not in out else None
                if isinstance(got, dict) and got.get("rank") == r:
                    try:
                        out[r] = WriteReport.from_json(got)
                    except (KeyError, TypeError, ValueError) as exc:
                        out[r] = self._failed(r, f"rank {others[r]}'s report of rank {r}'s shard is malformed "
                                                 f"({type(exc).__name__}: {exc})")
            waiting = [r for r in others if r not in out]
            if not waiting:
                return out
            if time.monotonic() > deadline or any(others[r] in gone for r in waiting):
                for r in waiting:
                    out[r] = self._failed(r, f"rank {others[r]} did not write rank {r}'s shard"
                                          + (" (it died)" if others[r] in gone else f" within {WRITE_WAIT_S:.0f} s"))
                return out
            time.sleep(0.02)

    # -- the shards -------------------------------------------------------------------------------

    def _snap(self, step: int, rank: int, p: Plan) -> dict[str, Any]:
        """`rank`'s small state at `step`: its snapshot, or its tail spliced with this rank's
        snapshot for the pieces `p.spliced` names (died after its optimizer step), less the
        published tensors that changed at that step (`p.from_memory`: its writer, a replica peer,
        takes them from memory)."""
        snap = stepsnap.read(self.dir / f"snap-{rank}-{step % 2}")
        pieces = dict(p.spliced).get(rank)
        if pieces is not None:
            tail = stepsnap.read(self.dir / f"snap-{rank}-tail")
            donor = stepsnap.read(self.dir / f"snap-{self.rank}-{step % 2}")
            if tail is None or tail.get("tail_of") is None or donor is None or donor["step"] != step:
                raise Uncovered(f"rank {rank}'s tail snapshot is gone")
            snap = stepsnap.splice(tail, donor, pieces)
            stale = dict(p.from_memory).get(rank, frozenset())  # changed at its optimizer step: a peer's memory
            snap["tensors"] = {n: v for n, v in snap["tensors"].items() if n not in stale}
            snap["missing"] = [*(snap.get("missing") or ()), *sorted(stale)]
        if snap is None or snap["step"] != step:
            raise Uncovered(f"rank {rank}'s snapshot of step {step} is gone")
        return snap

    def _shards(self, step: int, ranks: list[int], p: Plan) -> list[tuple[int, dict[str, Any], list[Any]]]:
        """(rank, skeleton, tensors) of each of `ranks`' shards at `step`, as that rank's own save
        would write them: the replicated tensors from this rank's memory, the per-rank state from
        its snapshot, and the pieces it did not publish from this rank's memory when this rank
        holds the same piece (itself, or a replica peer); DTensor specs are this rank's, moved to
        that rank's coordinate. Raises Uncovered."""
        assert self.state is not None and self.layout is not None
        replicated, replicas = self.layout.replicated, self.layout.replicas
        live_skeleton, live_tensors = flatten(self.state, {})
        live = dict(live_tensors)
        specs = live_skeleton.get("dtensors") or {}
        shared = [(n, t) for n, t in live_tensors if n in replicated]
        if failgpu.on_gpu(shared):  # stuck in an NCCL collective: abort it, copy on a side stream
            failgpu.release(self.pg)
            shared = failgpu.to_host(shared)
        out = []
        for r in ranks:
            snap = self._snap(step, r, p)
            skeleton, own = stepsnap.rebuild(snap, live_skeleton)
            needed = referenced(skeleton, skeleton["entries"])
            lacking = needed - {n for n, _ in shared} - {n for n, _ in own}
            unpublished = set(snap.get("missing") or ())
            held = {n for n in lacking if n in unpublished and n in live and holds(self.rank, r, n, replicas)}
            kept = self.snapshot_pieces.get(r, {}) if r in p.from_snapshot else {}
            # from its memory snapshot of `step`: a piece it did not publish, of the dtype this rank's is
            borrowed = {n: kept[n] for n in sorted(lacking - held)
                        if n in unpublished and n in kept and n in live and kept[n].dtype == live[n].dtype}
            if lacking - held - set(borrowed):
                raise Uncovered(f"rank {r}'s tensors {sorted(lacking - held - set(borrowed))[:4]} are on no survivor")
            tensors = [*shared, *own, *failgpu.to_host([(n, live[n]) for n in sorted(held)]), *borrowed.items()]
            theirs = {n: spec for n, spec in specs.items() if n in needed}
            if theirs:
                skeleton["dtensors"] = specs_at(theirs, r, self.rank, self.world, dict(tensors))
            out.append((r, skeleton, tensors))
        return out

    def _write_shard(self, step: int, rank: int, skeleton: dict[str, Any], tensors: list[Any],
                     into: str) -> WriteReport:
        # write_rank reads rank and world_size only (the per-node layout, which also reads the node's
        # links, is refused before)
        assert self.layout is not None
        return _commit.write_rank(self.root, step, cast(Any, Seat(rank, self.world)), skeleton, tensors,
                                  self.layout.replicated, into=into)


class Uncovered(Exception):
    """A shard this writer cannot write as its rank's own save would (the message says why)."""


def holds(writer: int, rank: int, name: str, replicas: Mapping[str, ReplicaDims]) -> bool:
    """Pure: whether `writer`'s piece `name` is `rank`'s: its own, or a replica peer's."""
    return writer == rank or (name in replicas and writer in peers_of(rank, replicas[name]))


def specs_at(specs: Mapping[str, dict[str, Any]], rank: int, me: int, world: int,
             tensors: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Pure: rank `me`'s DTensor specs (`dtensorspec.describe`) as `rank`'s: the offset and local shape
    at `rank`'s coordinate (`placement.local_box`), checked against the piece written for it.
    Raises Uncovered for a mesh that is not every rank in order (no coordinate follows from a rank)."""
    out = {}
    for name, spec in specs.items():
        if rank != me:
            if not arithmetic(spec, world):
                raise Uncovered(f"DTensor {name} is on a mesh that is not every rank in order: rank {rank}'s "
                                "place in it is not known")
            mesh = tuple(spec["mesh_shape"])
            offset, shape = local_box(tuple(spec["shape"]), mesh, coordinate(rank, mesh), tuple(spec["placements"]))
            spec = {**spec, "offset": list(offset), "local_shape": list(shape)}
        t = tensors.get(name)
        if t is not None and list(t.shape) != list(spec["local_shape"]):
            raise Uncovered(f"rank {rank}'s piece of {name} is {list(t.shape)}; its placements give "
                            f"{spec['local_shape']}")
        out[name] = spec
    return out


def _plan_json(p: Plan) -> dict[str, Any]:
    """The parts of the committer's plan the other writers follow (`_plan_from` reads them back)."""
    return {"shards": {str(r): w for r, w in p.shards},
            "spliced": {str(r): sorted(pieces) for r, pieces in p.spliced},
            "from_memory": {str(r): sorted(names) for r, names in p.from_memory},
            "from_snapshot": list(p.from_snapshot)}


def _plan_from(data: Mapping[str, Any], step: int, writer: int) -> Plan:
    """Pure inverse of `_plan_json`. Raises TypeError/ValueError/AttributeError when malformed."""
    def pairs(key: str) -> tuple[tuple[int, frozenset[str]], ...]:
        return tuple(sorted((int(r), frozenset(map(str, v))) for r, v in (data.get(key) or {}).items()))

    return Plan(step, writer, spliced=pairs("spliced"), from_memory=pairs("from_memory"),
                shards=tuple(sorted((int(r), int(w)) for r, w in (data.get("shards") or {}).items())),
                from_snapshot=tuple(int(r) for r in data.get("from_snapshot") or ()))

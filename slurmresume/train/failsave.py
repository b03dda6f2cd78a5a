"""The failure-time save: when a rank of this node dies without warning (SIGKILL, an OOM kill), the
ranks still alive commit the last step boundary they hold, without any collective with the dead
(DESIGN.md section 10). Only under the node launcher, with every rank on this node (the
launcher's node-local heartbeat directory holds what is published); CPU tensors only.

At each `ckpt.step(s)` (`FailureGuard.at_step`, every rank, before the step's agreement):
  - the first call learns which tensors are replicated (the same MAX reductions a save uses,
    `checkpoint.replicas.replicated_across`: collective, once per run);
  - each rank publishes its small state at `s` to `<heartbeat dir>/failsave/snap-R-{s % 2}`
    (`train.stepsnap`: plain values, sampler, optimizer hyper-parameters, the RNG of every
    generator the save covers, metrics, and the tensors that are not replicated when they are
    small; one checked pwrite). The last two steps stay.
  - the rank's "dirty" flag is cleared; torch.optim's global step pre-hook sets it, so a rank
    knows whether its tensors are still those of step `s`;
  - that pre-hook also publishes the rank's *tail* snapshot (`snap-R-tail`: its small state just
    before the optimizer step after `s`), and the next boundary records which pieces changed
    between the two (`tail_changed`, over the whole run). A rank killed after the gradient
    all-reduce and before its next `ckpt.step()` is then still covered (`survivors.plan`).

The death (`peers.Watcher`, a thread blocked on pidfds of this node's other ranks, no polling): a peer
that exits without having closed its Checkpointer. Then, on each survivor:
  1. freeze: no optimizer step may start any more (it blocks); a survivor already past its
     optimizer step finishes the step up to its `ckpt.step()`, which publishes that boundary and
     blocks (at most FINISH_WAIT_S: a survivor still dirty then holds nothing);
  2. publish its status (last boundary, clean or not) and wait for the other survivors'
     (at most STATUS_WAIT_S: a survivor that does not answer holds nothing);
  3. `survivors.plan` (pure): the newest step covered by every rank's snapshot and held clean by
     a survivor; its lowest such survivor writes every rank's shard (replicated tensors from its
     memory, per-rank state from the snapshots), then the manifest and the marker
     (`checkpoint.commit`: same checksums, same marker-last commit as any save);
  4. a `failure_save` event says what committed, or why nothing did (the missing pieces), and the
     survivor leaves at once (`os._exit`), before torchrun's SIGKILL.
A second failure during the failure save (the writer dies): the save's private directory is
never committed (no marker); the launcher resumes from the newest committed step.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from ..checkpoint import commit as _commit
from ..checkpoint.placement import arithmetic, local_box
from ..checkpoint.replicas import LIBRARY_PREFIX, replicated_across
from ..checkpoint.state import flatten, referenced
from ..contract import ENV_HEARTBEAT_DIR, ENV_RUN_ID
from ..events import EV_FAILURE_SAVE, EV_SAVE_COMMITTED, try_append_event
from . import ddp, rng, stepsnap
from .peers import Watcher, mark_done, peers, publish_pid, read_status, write_json, write_status
from .survivors import Plan, ReplicaDims, Snapshot, Status, coordinate, peers_of, plan

log = logging.getLogger("slurmresume")

SUBDIR = "failsave"
STATUS_WAIT_S = 10.0  # how long a survivor waits for the others' status (torchrun kills after 30 s)
FINISH_WAIT_S = 5.0  # how long a survivor past its optimizer step may take to reach its ckpt.step()
EXIT_GRACE_S = 3.0  # a rank whose script raised (a collective broke) waits this long for the death
EXIT_FAILED = 1  # a survivor's exit code after the failure save (torchrun reports the run failed)
WRITE_WAIT_S = 20.0  # how long the committer waits for the other writers' shards, and they for its directory


@dataclass(frozen=True)
class Seat:
    """Rank and world of a shard written on another rank's behalf (what `write_rank` reads)."""

    rank: int
    world_size: int


class FailureGuard:
    """One per Checkpointer, every rank. See the module docstring for the protocol."""

    def __init__(self, directory: Path, root: Path, rank: int, world: int) -> None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self.dir, self.root, self.rank, self.world = directory, root, rank, world
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._frozen = threading.Event()
        self._reported = threading.Event()  # this rank's status is out: nothing more is published
        self._boundary: int | None = None
        self._dirty = False
        self._state: Mapping[str, Any] | None = None
        self._layout: stepsnap.Layout | None = None
        self._slots = [os.open(self.dir / f"snap-{rank}-{slot}", os.O_RDWR | os.O_CREAT, 0o600)
                       for slot in ("0", "1", "tail")]
        self._meta: Any = None
        self._last_ddp: dict[str, str] | None = None
        self._tail: dict[str, str] | None = None  # digests of this step's tail capture
        self._tail_changed: set[str] = set()
        self._ddp_layout: dict[str, str] | None = None
        self._failing: threading.Thread | None = None
        self._watcher: Watcher | None = None
        self._hook = register_optimizer_step_pre_hook(self._on_optimizer_step)
        publish_pid(self.dir, rank)

    # -- the training thread --------------------------------------------------------------

    def at_step(self, step: int, state: Mapping[str, Any], metrics: Any, meta: Any, group: Any,
                ddp_buckets: Mapping[str, Any]) -> None:
        """Every rank, at the start of `ckpt.step(step)`: (once) the replicated set, then this
        rank's snapshot of `step`. Blocks for good once a peer died (the process exits from the
        failure-save thread)."""
        if self._reported.is_set() or (self._frozen.is_set() and self._layout is None):
            self._block()
        if self._layout is None:  # collective, once: every rank's first step()
            layout = ddp.capture(ddp_buckets) if ddp_buckets else {}
            skeleton, tensors = flatten(state, {"rng": rng.capture(), "ddp": layout} if layout else
                                        {"rng": rng.capture()})
            # the library's own per-rank state (RNG) is always published, never taken from memory
            replicated = {n for n in replicated_across(group, tensors, skeleton.get("dtensors"))
                          if not n.startswith(LIBRARY_PREFIX)}
            self._layout = stepsnap.Layout.learn(state, replicated, self.world)
        self._last_ddp = self._ddp_layouts(ddp_buckets)
        cap = stepsnap.collect(step, state, self._layout, self._last_ddp, metrics, meta)
        if self._tail is not None:
            self._tail_changed |= stepsnap.changed(self._tail, cap.digests)
            self._tail = None
        data = cap.encode(tail_changed=sorted(self._tail_changed))
        with self._lock:
            # frozen but not yet reported: this survivor finishes the step it was in (see on_death)
            if not self._reported.is_set():
                stepsnap.publish(self._slots[step % 2], data)
                self._boundary, self._dirty, self._state, self._meta = step, False, state, meta
        if self._frozen.is_set():
            self._block()
        self._watch()

    def _ddp_layouts(self, ddp_buckets: Mapping[str, Any]) -> dict[str, str]:
        """The DDP bucket layouts, without a collective: DDP rebuilds once (at the first step's
        capture, above), so a layout that is there stays."""
        if self._ddp_layout is None and ddp_buckets:
            if ddp.rebuild_pending(ddp_buckets):
                return {}
            layout = ddp.capture(ddp_buckets)
            if all(layout.values()):
                self._ddp_layout = layout
            return layout
        return self._ddp_layout or {}

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """torch.optim's global pre-hook, before any optimizer step: the first one after a
        boundary publishes this rank's tail snapshot, then marks the rank dirty."""
        if self._frozen.is_set():
            self._block()
        if not self._dirty and self._layout is not None and self._state is not None and self._boundary is not None:
            cap = stepsnap.collect(self._boundary, self._state, self._layout, self._last_ddp, None, self._meta)
            data = cap.encode(tail_of=self._boundary)
            with self._lock:
                if not self._frozen.is_set():
                    stepsnap.publish(self._slots[2], data)
            self._tail = cap.digests
        with self._lock:
            frozen = self._frozen.is_set()
            if not frozen:
                self._dirty = True
        if frozen:
            self._block()

    def _block(self) -> None:
        threading.Event().wait()  # the failure-save thread ends the process

    def _watch(self) -> None:
        if self._watcher is None:
            fds = peers(self.dir, self.world, self.rank)
            if fds is not None:
                self._watcher = Watcher(self.dir, fds, self.on_death)
                self._watcher.start()

    def close(self) -> None:
        """Every rank, at `Checkpointer.close()`: this rank ends normally (its peers must not take
        its exit for a death); stop watching."""
        mark_done(self.dir, self.rank)
        self._hook.remove()
        if self._watcher is not None:
            self._watcher.stop()

    def at_exit(self) -> None:
        """atexit, before anything else is released. A normal exit (the script forgot close()) is
        marked done, so its peers do not take it for a death; a script that died of an exception
        (a collective broke because a peer died) waits for the failure save, which exits; any other
        exception is this rank's own failure, which its peers save for."""
        if getattr(sys, "last_value", None) is None:  # a normal exit without close(): no death either
            mark_done(self.dir, self.rank)
            return
        if self._watcher is None:
            return
        deadline = time.monotonic() + EXIT_GRACE_S
        while self._failing is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._failing is not None:
            self._failing.join()

    # -- the failure-save thread ----------------------------------------------------------

    def on_death(self, dead: set[int]) -> None:
        """On the watcher thread: freeze, agree by files, write if chosen, exit."""
        self._failing = threading.current_thread()
        began = time.time()
        try:
            self._frozen.set()
            me = self._finish_step()
            write_status(self.dir, me)
            statuses, dead = self._gather(dead)
            snaps = {r: _snapshots(self.dir, r) for r in range(self.world)}
            p = plan(self.world, dead, statuses, snaps, replicated_known=self._layout is not None,
                     replicas=self._layout.replicas if self._layout is not None else None)
            self._act(p, dead, began)
        except Exception as exc:  # noqa: BLE001 - never leave a frozen rank behind
            log.warning("rank %d: failure save failed: %s", self.rank, exc)
        finally:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_FAILED)

    def _finish_step(self) -> Status:
        """This survivor's status, once it stands still: clean at its last boundary, or dirty (an
        optimizer step ran and the training thread did not reach its `ckpt.step()` within
        FINISH_WAIT_S: a collective after the optimizer step, a very slow step)."""
        deadline = time.monotonic() + FINISH_WAIT_S
        while True:
            with self._lock:
                if not self._dirty or time.monotonic() > deadline:
                    self._reported.set()
                    return Status(self.rank, self._boundary, not self._dirty)
            time.sleep(0.01)

    def _gather(self, dead: set[int]) -> tuple[dict[int, Status], set[int]]:
        deadline = time.monotonic() + STATUS_WAIT_S
        while True:
            dead = dead | (self._watcher.dead_now() if self._watcher is not None else set())
            statuses = {r: s for r in range(self.world) if r not in dead
                        if (s := read_status(self.dir, r)) is not None}
            if len(statuses) + len(dead) >= self.world or time.monotonic() > deadline:
                return statuses, dead
            time.sleep(0.02)

    def _act(self, p: Plan, dead: set[int], began: float) -> None:
        survivors = [r for r in range(self.world) if r not in dead]
        if p.ok and p.writer == self.rank:
            assert p.step is not None
            try:
                outcome = self._write(p)
            except Exception as exc:  # noqa: BLE001 - a failure save that fails is reported, never raised
                outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            seconds = round(time.time() - began, 3)
            if outcome.get("already"):  # a periodic save of the same step won the race: nothing to add
                log.warning("rank(s) %s died: step %d is committed already", sorted(dead), p.step)
            elif outcome.get("ok"):
                log.warning("rank(s) %s died: failure save of step %d committed by rank %d in %.2f s",
                            sorted(dead), p.step, self.rank, seconds)
                try_append_event(self.root, EV_SAVE_COMMITTED, step=p.step, seconds=seconds, reason="failure",
                                 world_size=self.world, run_id=os.environ.get(ENV_RUN_ID))
            else:
                log.warning("failure save of step %d not committed: %s", p.step, outcome.get("error"))
            try_append_event(self.root, EV_FAILURE_SAVE, step=p.step, committed=bool(outcome.get("ok")),
                             already=bool(outcome.get("already")) or None, dead=sorted(dead), writer=self.rank,
                             writers={str(r): w for r, w in p.shards} or None,
                             seconds=seconds, error=outcome.get("error"), run_id=os.environ.get(ENV_RUN_ID))
        elif p.ok and any(w == self.rank for _, w in p.shards):
            self._help(p)
        elif not p.ok and survivors and self.rank == survivors[0]:
            log.warning("ranks %s died: no failure save (missing: %s); resuming from the newest committed step",
                        sorted(dead), "; ".join(p.refused))
            try_append_event(self.root, EV_FAILURE_SAVE, step=None, committed=False, dead=sorted(dead),
                             missing=list(p.refused), run_id=os.environ.get(ENV_RUN_ID))

    # -- the writers: the committer (`Plan.writer`) and the holders of pieces it lacks (`Plan.shards`) --

    def _write(self, p: Plan) -> dict[str, Any]:
        """The committer: its private directory (announced to the other writers), the shards it
        writes, the other writers' reports, then the commit; returns commit's outcome."""
        from ..checkpoint.nodefile import layout_from_env

        assert p.step is not None
        step, others = p.step, dict(p.shards)
        if layout_from_env() != "per-rank":
            return self._refuse(step, "the per-node shard layout is not written by a failure save yet")
        try:
            first = self._snap(step, 0, p)  # its metrics and meta go into the manifest
            shards = self._shards(step, [r for r in range(self.world) if r not in others], p)
        except _Uncovered as exc:
            return self._refuse(step, str(exc))
        decision = _commit.prepare(self.root, step)
        if decision["action"] == "skip":
            self._announce(step, {"action": "skip"})
            return {"ok": True, "error": None, "already": True}
        if decision["action"] != "write":
            return self._refuse(step, decision.get("error"))
        self._announce(step, {"action": "write", "dir": decision["dir"], "shards": {str(r): w for r, w in others.items()}})
        reports = {r: self._write_shard(step, r, skeleton, tensors, decision["dir"]) for r, skeleton, tensors in shards}
        reports.update(self._reports(step, others))
        return _commit.commit(self.root, step, [reports[r] for r in range(self.world)], first["metrics"],
                              first["meta"], into=decision["dir"])

    def _refuse(self, step: int, error: str | None) -> dict[str, Any]:
        self._announce(step, {"action": "error", "error": error})  # the other writers stop waiting
        return {"ok": False, "error": error}

    def _help(self, p: Plan) -> None:
        """A holder of pieces the committer lacks: once the committer announced its directory,
        write the shards it assigned to this rank (`Plan.shards`) into it and report each."""
        assert p.step is not None and p.writer is not None
        step = p.step
        announced = self._announced(step, p.writer)
        if announced is None or announced.get("action") != "write":
            log.warning("rank %d: no failure save of step %d to write into (%s)", self.rank, step,
                        "the committer did not answer" if announced is None else announced.get("error")
                        or announced.get("action"))
            return
        mine = sorted(int(r) for r, w in announced.get("shards", {}).items() if w == self.rank)
        try:
            if self._boundary != step or self._dirty:
                raise _Uncovered(f"rank {self.rank} does not hold step {step}")
            shards = self._shards(step, mine, p)
        except _Uncovered as exc:
            for r in mine:
                write_json(self.dir / f"report-{step}-{r}.json", {"rank": r, "error": str(exc)})
            return
        for r, skeleton, tensors in shards:
            write_json(self.dir / f"report-{step}-{r}.json",
                       self._write_shard(step, r, skeleton, tensors, announced["dir"]))

    def _announce(self, step: int, decision: dict[str, Any]) -> None:
        write_json(self.dir / f"save-{step}.json", decision)

    def _announced(self, step: int, writer: int) -> dict[str, Any] | None:
        """The committer's decision for `step`; None when it died or stayed silent (WRITE_WAIT_S)."""
        deadline = time.monotonic() + WRITE_WAIT_S
        while True:
            got = _read_json(self.dir / f"save-{step}.json")
            if got is not None:
                return got
            if time.monotonic() > deadline or writer in self._dead_now():
                return None
            time.sleep(0.02)

    def _reports(self, step: int, others: Mapping[int, int]) -> dict[int, dict[str, Any]]:
        """The other writers' reports (rank -> report); a writer that died or stayed silent
        (WRITE_WAIT_S) leaves an error report for each of its shards: nothing is committed."""
        deadline = time.monotonic() + WRITE_WAIT_S
        out: dict[int, dict[str, Any]] = {}
        while True:
            for r in others:
                if r not in out and (got := _read_json(self.dir / f"report-{step}-{r}.json")) is not None:
                    out[r] = got
            waiting = [r for r in others if r not in out]
            if not waiting:
                return out
            gone = self._dead_now()
            if time.monotonic() > deadline or any(others[r] in gone for r in waiting):
                for r in waiting:
                    out[r] = {"rank": r, "error": f"rank {others[r]} did not write rank {r}'s shard"
                              + (" (it died)" if others[r] in gone else f" within {WRITE_WAIT_S:.0f} s")}
                return out
            time.sleep(0.02)

    def _dead_now(self) -> set[int]:
        return self._watcher.dead_now() if self._watcher is not None else set()

    def _snap(self, step: int, rank: int, p: Plan) -> dict[str, Any]:
        """`rank`'s small state at `step`: its snapshot, or its tail spliced with this rank's
        snapshot for the pieces `p.spliced` names (died after its optimizer step)."""
        snap = stepsnap.read(self.dir / f"snap-{rank}-{step % 2}")
        pieces = dict(p.spliced).get(rank)
        if pieces is not None:
            tail = stepsnap.read(self.dir / f"snap-{rank}-tail")
            donor = stepsnap.read(self.dir / f"snap-{self.rank}-{step % 2}")
            if tail is None or tail.get("tail_of") is None or donor is None or donor["step"] != step:
                raise _Uncovered(f"rank {rank}'s tail snapshot is gone")
            snap = stepsnap.splice(tail, donor, pieces)
        if snap is None or snap["step"] != step:
            raise _Uncovered(f"rank {rank}'s snapshot of step {step} is gone")
        return snap

    def _shards(self, step: int, ranks: list[int], p: Plan) -> list[tuple[int, dict[str, Any], list[Any]]]:
        """(rank, skeleton, tensors) of each of `ranks`' shards at `step`, as that rank's own save
        would write them: the replicated tensors from this rank's memory, the per-rank state from
        its snapshot, and the pieces it did not publish (FSDP2/HSDP) from this rank's memory when
        this rank holds the same piece (itself, or a replica peer: `Layout.replicas`); DTensor
        specs are this rank's, moved to that rank's coordinate. Raises _Uncovered."""
        assert self._state is not None and self._layout is not None
        replicated, replicas = self._layout.replicated, self._layout.replicas
        live_skeleton, live_tensors = flatten(self._state, {})
        live = dict(live_tensors)
        specs = live_skeleton.get("dtensors") or {}
        shared = [(n, t) for n, t in live_tensors if n in replicated]
        out = []
        for r in ranks:
            snap = self._snap(step, r, p)
            skeleton, own = stepsnap.rebuild(snap, live_skeleton)
            needed = referenced(skeleton, skeleton["entries"])
            lacking = needed - {n for n, _ in shared} - {n for n, _ in own}
            held = [n for n in sorted(lacking) if n in snap.get("missing", ()) and _holds(self.rank, r, n, replicas)]
            if lacking - set(held):
                raise _Uncovered(f"rank {r}'s tensors {sorted(lacking - set(held))[:4]} are on no survivor")
            tensors = [*shared, *own, *((n, live[n]) for n in held)]
            if any(t.device.type != "cpu" for _, t in tensors):
                raise _Uncovered("tensors on a GPU: the failure save is written from CPU tensors only")
            mine = {n: spec for n, spec in specs.items() if n in needed}
            if mine:
                skeleton["dtensors"] = _specs_at(mine, r, self.rank, self.world, dict(tensors))
            out.append((r, skeleton, tensors))
        return out

    def _write_shard(self, step: int, rank: int, skeleton: dict[str, Any], tensors: list[Any],
                     into: str) -> dict[str, Any]:
        # write_rank reads rank and world_size only (the per-node layout, which also reads the node's
        # links, is refused before)
        return _commit.write_rank(self.root, step, cast(Any, Seat(rank, self.world)), skeleton, tensors,
                                  self._layout.replicated if self._layout is not None else set(), into=into)


class _Uncovered(Exception):
    """A shard this writer cannot write as its rank's own save would (the message says why)."""


def _holds(writer: int, rank: int, name: str, replicas: Mapping[str, ReplicaDims]) -> bool:
    """Whether `writer`'s piece `name` is `rank`'s: its own, or a replica peer's (`Layout.replicas`)."""
    return writer == rank or (name in replicas and writer in peers_of(rank, replicas[name]))


def _specs_at(specs: Mapping[str, dict[str, Any]], rank: int, me: int, world: int,
              tensors: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Pure: this rank's DTensor specs (`reshard.describe`) as `rank`'s: the offset and local shape
    of `rank`'s coordinate (`placement.local_box`), checked against the piece written for it.
    Raises _Uncovered for a mesh that is not every rank in order (no coordinate follows from a rank)."""
    out = {}
    for name, spec in specs.items():
        if rank != me:
            if not arithmetic(spec, world):
                raise _Uncovered(f"DTensor {name} is on a mesh that is not every rank in order: rank {rank}'s "
                                 "place in it is not known")
            mesh = tuple(spec["mesh_shape"])
            offset, shape = local_box(tuple(spec["shape"]), mesh, coordinate(rank, mesh), tuple(spec["placements"]))
            spec = {**spec, "offset": list(offset), "local_shape": list(shape)}
        t = tensors.get(name)
        if t is not None and list(t.shape) != list(spec["local_shape"]):
            raise _Uncovered(f"rank {rank}'s piece of {name} is {list(t.shape)}, its placements give "
                             f"{spec['local_shape']}")
        out[name] = spec
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def failure_guard(group: Any, root: Path) -> FailureGuard | None:
    """The guard when this rank runs under the launcher with its whole world on this node, else
    None (a bare run, one rank, several nodes: not yet covered)."""
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    world = group.world_size
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if not directory or world < 2 or local != str(world) or not os.path.isdir(directory):
        return None
    try:
        return FailureGuard(Path(directory) / SUBDIR, root, group.rank, world)
    except OSError as exc:
        log.warning("no failure save on rank %d: %s", group.rank, exc)
        return None


def _snapshots(directory: Path, rank: int) -> list[Snapshot]:
    out = []
    for slot in ("0", "1", "tail"):
        snap = stepsnap.read(directory / f"snap-{rank}-{slot}")
        if snap is not None:
            out.append(Snapshot(rank, snap["step"], tuple(snap.get("missing") or ()), snap.get("tail_of"),
                                snap.get("digests") or {}, frozenset(snap.get("tail_changed") or ())))
    return out

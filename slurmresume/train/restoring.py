"""Restore with fallback: the newest checkpoint that loads on every rank, as one collective call.

Call order (`restore_collective`, every rank; "0" = rank 0 only; each arrow one collective):

  1. 0:   choose (`pick`): pull a newer step from the mirror (first round only), find the
          newest committed step not tried yet (or exactly `step`), check its shards when it
          predates per-block digests; or refuse a fresh start on a root that had progress
          -> broadcast RestoreChoice | Failure | None
  2. all: a Failure raises its exception on every rank; None is a fresh start (or, for an
          explicit `step`, an error); a world size the checkpoint cannot be loaded on raises.
  3. 0:   the bytes of the chosen manifest that it read and validated (`share_manifest`)
          -> broadcast (length, then payload): no rank but 0 opens manifest.json
     all: plan and read this rank's part (`restoreplan.plan_part`, `restoreplan.read_part`) into
          staging memory, every byte checked against its recorded digest as it is read; nothing
          in `state` is touched
          -> gather the load errors (Failure | None), broadcast the first: the collective verdict.
          Whatever a rank's plan or read raises is its error here, never raised on it alone.
  4. all: no error anywhere: apply (`apply_loaded`: copy into the live tensors, load_state_dict)
          and return the choice; a ConfigError (the state does not fit) or an unexpected
          exception (a bug) on any rank: every rank raises it (ConfigError, RankFailedError),
          naming the rank, and no older step is tried; else (a checkpoint problem: rank 0 logs)
          fall back to the next older step from 1, unless `step` was explicit. A refused step
          leaves `state` bitwise as it was on every rank, so a fallback (or a caller that catches
          the error) starts from untouched objects.

Warm (every rank's shards in the page cache, same world size, no staging budget set): step 3
verifies without keeping and the copy into the live state is a second verified read, both from
memory (no staging memory to fault in); a file that changes between the two passes then leaves
the state half-loaded, with an error on every rank saying so.

Memory: the staging costs, on each rank, the bytes of the tensors that rank loads (its own
shard's tensors, the replicated ones, its box of each DTensor), in CPU memory, for the duration
of the restore; it is freed once copied into the live state. No rank holds a second rank's part.
Every rank but 0 receives the manifest's bytes (O(W + T): ~1.5 MiB at 16,384 ranks) once per step
tried and drops them once its plan has parsed them.

`restore_and_record` is what `Checkpointer.restore` calls: the above, then what was loaded
(`CheckpointInfo`) and its record (rank 0: the log line and the `restored` event).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checkpoint import exchange
from ..checkpoint.agreement import LoadAgreement
from ..checkpoint.collective import Group
from ..checkpoint.landed import Landing
from ..checkpoint.layout import MARKER, step_dir_name, step_dirs
from ..checkpoint.residency import all_cached
from ..checkpoint.sharding import to_json as sharding_json
from ..checkpoint.state import apply_entries, flatten_live
from ..checkpoint.store import (
    CheckpointInfo,
    clean_temp_files,
    inspect_dir,
    unreadable_error,
)
from ..contract import ENV_ALLOW_FRESH_START, ENV_RESTORE_STAGING, ENV_RESTORE_WARM, ENV_RUN_ID
from ..errors import CheckpointError, ConfigError, CorruptCheckpointError
from ..events import EV_RESTORED, process_started_at, try_append_event
from ..importtime import IMPORTED_AT
from ..storage import DirRoot
from . import rng
from .heartbeat import expect_io
from .messages import DECISIVE, Failure, Pick, RestoreChoice, pick_from_json, pick_to_json
from .restoreplan import (
    Loaded,
    Part,
    gc_paused,
    plan_part,
    read_part,
    staging_budget,
    with_manifest,
)

log = logging.getLogger("slurmresume")
MAX_FAILURES = 4  # load errors every rank receives (the first is the one reported)


@dataclass(frozen=True)
class Request:
    """What `Checkpointer.restore` asks for (its arguments, defaults resolved)."""

    step: int | None
    verify: bool
    restore_rng: bool
    strict: bool
    allow_fresh_start: bool
    ddp_buckets: Any = None  # the Checkpointer's DDPTracker (train/ddptrack.py): pins the saved layouts
    # the two passes from memory (see ENV_RESTORE_WARM) where every rank's files are resident; None:
    # as $SLURMRESUME_RESTORE_WARM says. True for the memory tier (memrestore.py): its root is this
    # job's own tmpfs, which nothing writes between the passes, and the first pass verifies every
    # byte before the live state is touched
    warm: bool | None = None
    # every rank reads the chosen step under its own `root`, not rank 0's path: the memory tier on
    # several nodes, where each node's root is its own tmpfs holding its ranks' shards (memtier.py)
    own_root: bool = False

    @classmethod
    def of(cls, step: int | None, verify: bool, restore_rng: bool, strict: bool,
           allow_fresh_start: bool | None) -> Request:
        """`allow_fresh_start=None`: $SLURMRESUME_ALLOW_FRESH_START == "1"."""
        if allow_fresh_start is None:
            allow_fresh_start = os.environ.get(ENV_ALLOW_FRESH_START) == "1"
        return cls(step, verify, restore_rng, strict, allow_fresh_start)


def restore_and_record(group: Group, root: Path, state: MutableMapping[str, Any], req: Request, mirror: Any, *,
                       created_at: float, memory: Path | None = None) -> CheckpointInfo | None:
    """Collective: from the memory tier's root `memory` first when it holds a step at least as
    new as the file tier's (`memrestore.from_memory`: one fallback at most, named), else
    `restore_collective` on `root`; then every rank inspects what it loaded (the returned
    `CheckpointInfo`, `Checkpointer.restored`) and rank 0 logs it and writes the `restored` event
    (its `tier`: memory or file, and a memory fallback's reason)
    with this rank's start-up breakdown: the process's start, the end of the script's imports
    (slurmresume imported), the Checkpointer's creation (`created_at`), the restore. None on a
    fresh start (logged once, by rank 0)."""
    started = time.perf_counter()
    restore_began = time.time()
    choice: RestoreChoice | None = None
    io: list[list[int]] = []
    fallback: str | None = None
    if memory is not None:
        from .memrestore import from_memory

        choice, io, fallback = from_memory(group, memory, root, state, req, restore_collective)
    tier = "memory" if choice is not None else "file"
    if choice is None:
        choice, io = restore_collective(group, root, state, req, mirror)
        if memory is not None:  # memory snapshots past this step: another trajectory's (each node's first rank)
            from .memtier import forget_from, node_leader

            if node_leader():
                forget_from(memory, choice.step + 1 if choice is not None else 0)
    if choice is None:
        if group.rank == 0:
            log.info("fresh start: no complete checkpoint under %s", root)
        return None
    # every rank parsed the manifest once, to plan its read: what it loaded is that, no file opened
    info = CheckpointInfo(choice.step, Path(choice.path), True, manifest=choice.manifest)
    if group.rank == 0:
        log.info("restored from step %d (%s) in %.2f s%s", choice.step, choice.path, time.perf_counter() - started,
                 " (memory tier)" if tier == "memory" else "")
        extra = {"tier": tier, "memory_fallback": fallback} if memory is not None else {}
        try_append_event(root, EV_RESTORED, step=choice.step, run_id=os.environ.get(ENV_RUN_ID), **extra,
                         process_started_at=process_started_at(), imported_at=IMPORTED_AT, created_at=created_at,
                         restore_began_at=restore_began, restore_s=round(time.time() - restore_began, 4),
                         **read_summary(io))
    return info


def read_summary(io: list[list[int]], per_rank_up_to: int = 256) -> dict[str, Any]:
    """The `restored` event's read figures from each rank's [bytes read, bytes needed] (tensor
    data only; headers are not counted): totals, the rank that read the most per byte it needed
    and that ratio, and the per-rank lists while the world is at most `per_rank_up_to` ranks
    (the event stays one short line at any scale)."""
    ratios = [r / n if n else 1.0 for r, n in io]
    worst = max(range(len(io)), key=ratios.__getitem__, default=0)
    out: dict[str, Any] = {"read_bytes_total": sum(r for r, _ in io), "needed_bytes_total": sum(n for _, n in io),
                           "read_ratio_max": round(ratios[worst], 4) if io else 1.0, "read_ratio_max_rank": worst}
    if len(io) <= per_rank_up_to:
        out["read_bytes"], out["needed_bytes"] = [r for r, _ in io], [n for _, n in io]
    return out


def restore_collective(group: Group, root: Path, state: MutableMapping[str, Any], req: Request,
                       mirror: Any = None) -> tuple[RestoreChoice | None, list[list[int]]]:
    """Collective (see the module docstring). Returns the checkpoint loaded into `state` (None on
    a fresh start; `choice.manifest` is this rank's parse of its manifest) and, per rank,
    [tensor data bytes read, bytes needed] for it. Raises the same
    error on every rank when nothing may be loaded."""
    tried: set[int] = set()
    budget = staging_budget(os.environ.get(ENV_RESTORE_STAGING), _mem_available(),
                            int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    while True:
        verify = req.verify or bool(tried)
        mine = pick(root, req.step, verify, tried, req.allow_fresh_start, mirror) if group.rank == 0 else None
        choice = pick_from_json(group.broadcast_json(pick_to_json(mine)))
        if isinstance(mine, RestoreChoice) and isinstance(choice, RestoreChoice):
            choice = mine  # rank 0 keeps its parse of the manifest (it never crosses ranks)
        elif req.own_root and isinstance(choice, RestoreChoice):
            choice = replace(choice, path=str(root / step_dir_name(choice.step)))
        if isinstance(choice, Failure):  # raised on every rank, same kind (rank 0: from its cause)
            raise choice.error() from (mine.cause if isinstance(mine, Failure) else None)
        if choice is None:
            if req.step is not None:
                raise CheckpointError(f"step {req.step} is not a complete checkpoint under {root}: "
                                      f"run `slurmresume status --ckpt-dir {root}` to list them")
            return None, []
        if choice.world_size != group.world_size and not choice.elastic:
            raise CheckpointError(
                f"checkpoint {choice.path} was written by {choice.world_size} ranks, this run has "
                f"{group.world_size}, and it holds per-rank (sharded) tensors: run with "
                f"--nodes/--nproc-per-node giving {choice.world_size} ranks")
        failures, io, manifest = load_choice(group, root, state, req, choice, budget)
        if not failures:
            return replace(choice, manifest=manifest), io
        if group.rank == 0:
            log.warning("checkpoint step %s (%s) unusable: %s; falling back to the previous one",
                        choice.step, choice.path, failures[0].message)
        if req.step is not None:
            raise CorruptCheckpointError(failures[0].message)
        tried.add(choice.step)


def load_choice(group: Group, root: Path, state: MutableMapping[str, Any], req: Request, choice: RestoreChoice,
                budget: int | None) -> tuple[list[Failure], list[list[int]], Any]:
    """Collective: load `choice` into `state`, all or nothing. Returns every rank's load errors
    (none: `state` holds the step; some: `state` is untouched), [bytes read, needed] per rank,
    and this rank's parse of the manifest (None when its plan failed). Raises, on every rank, a
    ConfigError or an unexpected exception of any rank (RankFailedError), `state` untouched."""
    # The cyclic GC is paused for the whole load, not for the plan alone (see plan_part): the
    # plan's ~10^5 objects (the JSON of manifest, header and skeleton), none in a cycle, live
    # until the read is done. Re-enabled right after the plan, the next allocation ran a
    # collection that walked them all (405B at 16,384 ranks: 4-11 ms of every rank's plan);
    # re-enabled once they are dropped, it finds only what the restore keeps.
    with gc_paused():
        return _load_choice(group, root, state, req, choice, budget)


def _load_choice(group: Group, root: Path, state: MutableMapping[str, Any], req: Request, choice: RestoreChoice,
                 budget: int | None) -> tuple[list[Failure], list[list[int]], Any]:
    # Into staging memory, verified as read: the live state is written only once every rank's
    # part of this step has verified (the all_gather is the verdict). A part larger than the
    # staging budget on any rank: every rank verifies without keeping (pass 1), and reads into
    # the live tensors only after that verdict (pass 2).
    # Warm (every rank's files in the page cache, same world size), opted in with
    # SLURMRESUME_RESTORE_WARM=1 and no staging budget set: two passes too, both from memory,
    # ~3x faster than faulting in staging memory and copying from it (residency.py), at the cost
    # written in contract.ENV_RESTORE_WARM. A budget set explicitly is obeyed as it says.
    # Whatever one rank's plan or read raises becomes its part of the verdict, never an exception
    # raised on that rank alone (its peers would wait in the next collective until gloo fails).
    live: dict[str, Any] = {}
    keys: list[str] = []
    part: Part | Failure
    over = warm = False
    xplan: exchange.Plan | None = None
    sent = share_manifest(group, choice)  # collective: before anything one rank may fail alone
    try:
        live, keys = flatten_live(state), list(state)
        planned = with_manifest(choice, sent)  # a rank but 0: its manifest from rank 0's bytes
        sent = b""  # parsed: not held by the plan or the read
        part = plan_part(group.rank, planned, state, live, req.strict)
        xplan = exchange_plan(group, choice, part)
        extra = xplan.peak_bytes if xplan is not None else 0
        over = isinstance(part, Part) and budget is not None and part.staging + extra > budget
        wanted = req.warm if req.warm is not None else os.environ.get(ENV_RESTORE_WARM, "").strip() == "1"
        warm = (wanted
                and not os.environ.get(ENV_RESTORE_STAGING, "").strip()
                and cached(part, choice.world_size == group.world_size))
    except Exception as exc:  # noqa: BLE001 - crosses ranks as data (Failure.on_rank)
        part, xplan = caught(group, exc, f"planning its read of step {choice.step}"), None
    sent = b""  # (refused before the plan: not kept either)
    agreed = LoadAgreement.agree(group, over_budget=over, warm=warm, planned=xplan is not None,
                                 digest=xplan.digest if xplan is not None else 0,
                                 forced=xplan is not None and xplan.forced)
    two_pass = agreed.two_pass
    # the exchange only where every rank planned one from the same inputs (else each reads its own
    # boxes), and, unless every rank forces it, where reading their own boxes would open too many
    # files (agreed is the same on every rank: the SUM is made by all or none)
    same = agreed.same_exchange
    if same and not agreed.exchange_forced and isinstance(part, Part):
        same = exchange.worth_it(group.sum_int(len(part.sources | {part.src})), group.world_size)
    swap = (group, xplan) if same and xplan is not None else None
    if isinstance(part, Part):  # the hang watch scales this rank's budget with the bytes it reads
        expect_io("restore", part.staging * (2 if two_pass else 1))
    got = _read(group, choice, part, keys, live, req.strict, "verify" if two_pass else "stage", swap)
    failures, io = _verdict(group, got)
    if failures and failures[0].decisive:  # every rank, the same error: no older step is tried
        raise failures[0].error() from _cause(failures[0], got)
    if not failures and two_pass:
        first_read = got.read
        got = _read(group, choice, part, keys, live, req.strict, "live", swap)
        failures, io = _verdict(group, replace(got, read=first_read + got.read))
        if failures:  # the files changed between the passes, or a read failed the second time
            first = failures[0]
            message = (f"restoring step {choice.step} under {root} failed while it read into the live state, after "
                       f"every rank had verified it ({first.message}): the in-memory state is undefined; run "
                       f"`slurmresume verify --all --ckpt-dir {root}` and restart")
            raise (first.error(message) if first.decisive else CheckpointError(message)) from _cause(first, got)
    if not failures:
        apply_loaded(group, state, got, choice, req.restore_rng, swap is not None)
        if req.ddp_buckets is not None and isinstance(got.library, dict):
            req.ddp_buckets.restore(got.library.get("ddp"))
    if isinstance(part, Part):
        part.opened.close()  # (an exception above: closed when the plan is dropped)
    return failures, io, part.manifest if isinstance(part, Part) else None


def exchange_plan(group: Group, choice: RestoreChoice, part: Part | Failure) -> exchange.Plan | None:
    """This rank's plan for reading a reshard's saved shards once each (`checkpoint.exchange`), or
    None: the same world size, a plan that failed, a step whose pieces are listed rather than
    placed by arithmetic, specs the exchange does not serve, or not wanted
    (SLURMRESUME_RESHARD_EXCHANGE, EXCHANGE_MIN_RANKS)."""
    if (not isinstance(part, Part) or not part.wanted or choice.world_size == group.world_size
            or not part.manifest.placed_by_arithmetic):
        return None
    answer = exchange.wanted(exchange.setting(), group.world_size)
    planned = None if answer == "off" else exchange.plan(group.rank, group.world_size, choice.world_size,
                                                         part.wanted, part.where, part.boxes)
    if planned is not None:
        planned.forced = answer == "on"
    return planned


def share_manifest(group: Group, choice: RestoreChoice) -> bytes:
    """Collective (every rank, once per step tried, right after the choice's broadcast): the bytes
    of the chosen manifest that rank 0 read and validated, sent by one broadcast (length, then
    payload), so that no rank but 0 opens manifest.json (W opens of one file against one metadata
    server). Returns them on every rank but 0; rank 0 (it has its parse) gets b"" and drops its
    copy. When rank 0 has none to send (a manifest `read_manifest` did not read), every rank gets
    b"" and the others read the file (`manifest.read_pinned`). A world of one sends nothing."""
    mine = choice.manifest if group.rank == 0 else None
    raw = (mine.raw_bytes or b"") if mine is not None else b""
    if mine is not None:
        mine.raw_bytes = None  # sent (or no one to send to): not kept for the run
    got = group.broadcast_bytes(raw)
    return b"" if group.rank == 0 else got


def cached(part: Part | Failure, same_world: bool) -> bool:
    """This rank reads its part from the page cache: the world size is unchanged (its pieces are
    in its own shard) and its shard, and shard 0 when it reads replicated tensors, are cached."""
    if not same_world or isinstance(part, Failure):
        return False
    files = [part.shard["file"]] + ([part.first["file"]] if part.shared else [])
    return all(all_cached(part.directory / f) for f in files)


def _verdict(group: Group, got: Loaded) -> tuple[list[Failure], list[list[int]]]:
    """Collective: the load errors (the verdict: rank 0 gathers each rank's fixed-size record and
    broadcasts the first few errors, decisive ones first, else in rank order) and, on rank 0
    only, [bytes read, bytes needed] per rank."""
    records = group.gather_json({"failure": got.failure and got.failure.to_json(), "io": [got.read, got.needed]})
    mine = first_failures([r["failure"] for r in records if r["failure"]]) if records is not None else None
    failures = group.broadcast_json(mine)
    return [Failure.from_json(f) for f in failures], [r["io"] for r in records] if records is not None else []


def first_failures(failures: list[dict[str, Any]], most: int = MAX_FAILURES) -> list[dict[str, Any]]:
    """Pure, rank 0: the failures every rank receives (in rank order): the decisive ones (a
    ConfigError, a bug: they end the restore) first, so that the one every rank raises is never
    cut off by a checkpoint problem of a lower rank; a rank's report that the rank reading a shard
    for it failed ("peer") last, after that rank's own error."""
    return sorted(failures, key=lambda f: (f["kind"] not in DECISIVE, f["kind"] == "peer"))[:most]


def caught(group: Group, exc: Exception, doing: str) -> Failure:
    """This rank's `exc`, raised while `doing`, as its part of the verdict; an unexpected one (a
    bug) is logged here with its traceback, the only rank that has it."""
    failure = Failure.on_rank(exc, group.rank, group.world_size, doing)
    if failure.kind == "bug":
        log.error("%s", failure.message, exc_info=exc)
    return failure


def _cause(failure: Failure, got: Loaded) -> BaseException | None:
    """The original exception behind the verdict's `failure`, on the rank that raised it; none
    behind a ConfigError (the state does not fit: its one line says what to change, and the
    traceback inside slurmresume that chaining would print first only buries it)."""
    if failure.kind == "config":
        return None
    return got.failure.cause if got.failure is not None and got.failure == failure else None


def _read(group: Group, choice: RestoreChoice, part: Part | Failure, keys: list[str], live: dict[str, Any],
          strict: bool, mode: str, swap: Any = None) -> Loaded:
    """`read_part`, with whatever it raises as this rank's failure (see `load_choice`)."""
    try:
        return read_part(group.rank, choice, part, keys, live, strict, mode, swap)
    except Exception as exc:  # noqa: BLE001 - crosses ranks as data (Failure.on_rank)
        return Loaded(failure=caught(group, exc, f"reading its part of step {choice.step}"))


def pick(root: Path, step: int | None, verify: bool, tried: set[int], allow_fresh: bool, mirror: Any) -> Pick:
    """Rank 0: what every rank loads next; never raises (an error is returned as a Failure)."""
    try:
        choice = choose(root, step, verify, tried, mirror)
        if choice is None and step is None and not allow_fresh:
            refusal = fresh_start_refusal(root, tried) or (mirror and mirror.fresh_start_refusal(root))
            if refusal:
                return Failure("checkpoint", refusal)
        if choice is not None:
            clean_temp_files(Path(choice.path), committed=True)  # its marker was just read
        return choice
    except (CheckpointError, ConfigError, OSError) as exc:
        return Failure.of(exc)
    except Exception as exc:  # noqa: BLE001 - a bug: raised on every rank, none left in the broadcast
        log.error("rank 0 failed while choosing the step to restore", exc_info=exc)
        return Failure.on_rank(exc, 0, 1, "choosing the step to restore")


def fresh_start_refusal(root: Path, tried: set[int]) -> str | None:
    """Rank 0, when nothing loads: a root that holds committed step directories had progress;
    starting over from step 0 there would silently throw it away (a transient read error, a
    damaged disk). Directories without a marker (a save killed before its commit) do not count."""
    committed = [(s, p) for s, p in step_dirs(root) if (p / MARKER).exists()]
    if not committed:
        return None
    newest, path = committed[0]
    why = "it failed to load (see the warning above)" if newest in tried else inspect_dir(newest, path).problem
    return (f"refusing a fresh start: {root} holds {len(committed)} committed step "
            f"director{'y' if len(committed) == 1 else 'ies'} but none loads (newest {path.name}: {why}); "
            f"run `slurmresume verify --all --ckpt-dir {root}`, or pass "
            f"restore(..., allow_fresh_start=True) (or set {ENV_ALLOW_FRESH_START}=1) to start from step 0")


def choose(root: Path, step: int | None, verify: bool, tried: set[int], mirror: Any = None) -> RestoreChoice | None:
    """Rank 0: the newest complete step not in `tried` (or exactly `step`); None when there is none."""
    if mirror is not None and not tried:  # a newer (or the only) step may be on the bucket
        mirror.pull(root, step)  # step=N: fetched from the bucket if only it has N
        mirror.start(root)  # and finish an upload a requeued run left
    elif mirror is not None and step is None and (again := mirror.refetch(root, tried)) is not None:
        tried = tried - {again}  # the damaged local copy was replaced by the bucket's verified one
    # Rank 0 checks no file's size here: each rank checks the size of every file it opens (its
    # shard, its index, the shards of its boxes) and the verdict is collective, so a truncated
    # file still makes the step fall back, without 2 W metadata operations on rank 0.
    store = DirRoot(root)
    if step is not None:
        info = store.inspect(step, verify=verify, sizes=False)
        if not info.complete:
            if info.unreadable:  # a newer release's step, another user's: refused, never called corrupt
                raise unreadable_error(info)
            if info.has_marker:
                raise CorruptCheckpointError(f"checkpoint {info.path}: {info.problem}")
            return None
    else:
        found = store.latest(verify=verify, exclude=tried, sizes=False, warn=True)
        if found is None:
            return None
        info = found
    if not verify and info.manifest is not None and not info.manifest.has_block_digests:
        # Written before per-block digests: no read can be checked as it happens, so check
        # the whole shards first (one extra read pass), and fall back like any corruption.
        info = store.inspect(info.step, verify=True)
        if not info.complete:
            if step is not None:
                raise CorruptCheckpointError(f"checkpoint {info.path}: {info.problem}")
            log.warning("skipping %s: %s", info.path, info.problem)
            return choose(root, step, verify, tried | {info.step})
    m = info.manifest
    if m is None:  # inspect_dir gives a manifest with every complete step
        raise CorruptCheckpointError(f"checkpoint {info.path}: no manifest")
    try:
        # The DTensor pieces cross ranks only when no rank can derive them from the manifest
        # (a mesh that does not span every rank: rank 0 read every index file for them).
        pieces = {} if m.placed_by_arithmetic else sharding_json(m.sharded)
        return RestoreChoice(info.step, str(info.path), m.world_size, m.digest, pieces, m.elastic, manifest=m)
    except CorruptCheckpointError as exc:  # format 2: a damaged tensor index, read only now
        if step is not None:
            raise
        log.warning("skipping %s: %s", info.path, exc)
        return choose(root, step, verify, tried | {info.step})


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _sampled(check: Any) -> Any:
    """`check()`, or None when it raises (a tensor type the sampling does not know): the check is
    skipped on this rank, with a warning, never a restore that fails or a rank that leaves the
    collective after it."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 - an extra check must not take a restore down
        log.warning("could not check that the restored tensors were written (%s: %s)", type(exc).__name__, exc)
        return None


def apply_loaded(group: Group, state: MutableMapping[str, Any], got: Loaded, choice: RestoreChoice,
                 restore_rng: bool, exchanged: bool = False) -> None:
    """Every rank, once every rank has loaded and verified its part: the values into `state`
    (plain tensors copied in place where shape and dtype match), the RNG states."""
    assert got.decoded is not None  # only called when no rank failed
    landing = _sampled(lambda: Landing.before(state, got.decoded))
    apply_entries(state, got.decoded)
    # Collective: a load_state_dict that wrote nothing on any rank fails the restore on every rank
    # (never "restored"); a few sampled elements per tensor (checkpoint/landed.py)
    unchanged = _sampled(lambda: landing.unchanged(state, got.decoded)) if landing is not None else None
    failed = ConfigError(f"restoring step {choice.step}: {unchanged} by load_state_dict, though the checkpoint "
                         "holds other values: that object's load_state_dict did not load it, and the in-memory "
                         "state is not the checkpoint's; fix that object's load_state_dict") if unchanged else None
    failures, _ = _verdict(group, Loaded(failure=caught(group, failed, "loading") if failed else None))
    if failures:
        raise failures[0].error()
    rank, saved_world = group.rank, choice.world_size
    if rank >= saved_world:
        # No saved RNG for this rank: re-derive it from the step and rank (documented rule),
        # rather than cloning another rank's stream.
        rng.reseed(choice.step, rank)
        log.warning("rank %d: checkpoint %s has %d ranks; this rank's RNG is re-seeded from step and rank "
                    "and its per-rank state comes from rank %d", rank, choice.path, saved_world, rank % saved_world)
    elif restore_rng and isinstance(got.library, dict) and "rng" in got.library:
        rng.restore(got.library["rng"])
    if saved_world != group.world_size and rank == 0:
        log.warning("resharded: checkpoint %s was written by %d ranks, restored on %d (replicated tensors "
                    "from rank 0's shard, %d DTensor(s) read by box%s)", choice.path, saved_world,
                    group.world_size, len(choice.manifest.sharded if choice.manifest else choice.sharded),
                    ", each saved shard opened by one rank and sent" if exchanged else "")

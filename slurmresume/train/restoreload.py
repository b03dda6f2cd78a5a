"""Loading one chosen step, all or nothing, as one collective call (`load_choice`, every rank):
rank 0's manifest bytes shared (`share_manifest`), each rank's plan and read into staging memory
(`restoreplan`), a reshard's exchange (`exchange_plan`), the one- or two-pass agreement
(`checkpoint.agreement.LoadAgreement`), the verdict after each pass (`restoreverdict`), and only
then the live state written (`restoreapply`). `Request` is what the restore asks for.
`restoring` runs it once per step tried; the choice of the step is `restorechoice`'s.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checkpoint import exchange
from ..checkpoint.agreement import LoadAgreement
from ..checkpoint.collective import Group
from ..checkpoint.residency import all_cached
from ..checkpoint.state import flatten_live
from ..contract import ENV_ALLOW_FRESH_START, ENV_RESTORE_STAGING, ENV_RESTORE_WARM
from ..errors import CheckpointError
from .heartbeat import expect_io
from .messages import Failure, RestoreChoice
from .restoreapply import apply_loaded
from .restoreplan import (
    Loaded,
    Part,
    gc_paused,
    plan_part,
    read_part,
    with_manifest,
)
from .restoreverdict import caught, verdict


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
    failures, io = verdict(group, got)
    if failures and failures[0].decisive:  # every rank, the same error: no older step is tried
        raise failures[0].error() from _cause(failures[0], got)
    if not failures and two_pass:
        first_read = got.read
        got = _read(group, choice, part, keys, live, req.strict, "live", swap)
        failures, io = verdict(group, replace(got, read=first_read + got.read))
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

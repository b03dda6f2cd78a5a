"""One rank's part of a restore: plan it from the headers, then read it (`restoreload` runs the
collective flow around these, every rank calling them for its own part).

  plan_part (every rank): validate this rank's part of the chosen step against the live state
      and plan its read from the manifest, the headers and the skeleton (no tensor bytes read,
      nothing in `state` touched): a `Part`, or the checkpoint problem as a Failure.
  read_part (every rank): read, verify and decode that part ("stage": into fresh memory;
      "verify": check every byte, keep nothing; "live": into the live tensors, only after every
      rank's "verify" pass succeeded): a `Loaded`, or its checkpoint problem as its failure.
  staging_budget (pure): the bytes one rank may stage, above which a restore takes two passes.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..checkpoint import exchange
from ..checkpoint.boxes import plan_reads
from ..checkpoint.boxes import targets as reshard_targets
from ..checkpoint.deferred import loads_skeleton
from ..checkpoint.dtensorspec import is_dtensor
from ..checkpoint.manifest import read_pinned
from ..checkpoint.opened import OpenShards
from ..checkpoint.reshard import STATS as RESHARD_STATS
from ..checkpoint.reshard import load_sharded
from ..checkpoint.shard import SKELETON_KEY
from ..checkpoint.sharding import from_json
from ..checkpoint.shardread import MetaOnDemand, load_tensors, verify_tensors
from ..checkpoint.state import (
    check_fits,
    decode_entries,
    is_stateful,
    referenced,
    validate_skeleton,
)
from ..contract import ENV_RESTORE_STAGING
from ..errors import CheckpointError, ConfigError, CorruptCheckpointError
from . import rng
from .messages import Failure, RestoreChoice


@dataclass(frozen=True)
class Loaded:
    """One rank's read of its part of a checkpoint: the decoded entries and the library's own
    state (RNG), or the failure (a verify-only read has neither)."""

    decoded: dict[str, Any] | None = None
    library: Any = None
    failure: Failure | None = None
    read: int = 0  # tensor data bytes read (whole checksum blocks) ...
    needed: int = 0  # ... for this many bytes of tensors this rank loads


@dataclass(frozen=True)
class Part:
    """What one rank reads of a checkpoint, planned from the headers and the skeleton (no tensor
    bytes read): whole tensors of its own shard (`names`) and of shard 0 (`shared`, replicated),
    boxes of DTensors (`wanted` -> `where`), and the fresh memory a staged read takes. `opened`:
    the shard files the plan opened, read through the same fds (closed by `restoreload.load_choice`)."""

    directory: Path
    shard: dict[str, Any]
    first: dict[str, Any]
    manifest: Any
    src: int
    skeleton: Any
    names: set[str]
    shared: set[str]
    wanted: dict[str, Any]
    where: dict[str, Any]
    boxes: dict[str, Any]  # where -> (shape, global offset) of this rank's box (boxes.plan_reads)
    staging: int
    opened: OpenShards
    sources: frozenset[int] = frozenset()  # the saved ranks whose shards this rank's boxes span


def with_manifest(choice: RestoreChoice, sent: bytes) -> RestoreChoice:
    """A rank other than 0, before its plan: `choice` with its manifest, built from `sent`, the
    bytes rank 0 read and sent (`restoreload.share_manifest`), or, none sent (b""), read from the
    step directory; either way checked against the digest rank 0 pinned (`manifest.read_pinned`:
    CorruptCheckpointError / UnsafeCheckpointError). Rank 0's choice, which holds its own parse,
    is returned as it is. The caller drops `sent` then: the plan never holds the bytes. (The
    parse makes ~10^5 objects, as the plan does: `restoreload.load_choice` runs both, and the read,
    in one `gc_paused`.)"""
    if choice.manifest is not None:
        return choice
    return replace(choice, manifest=read_pinned(Path(choice.path), choice.step, choice.manifest_xxh3, sent or None))


def plan_part(rank: int, choice: RestoreChoice, state: MutableMapping[str, Any], live: dict[str, Any],
              strict: bool) -> Part | Failure:
    """Every rank: validate this rank's part of `choice` against the live state and plan its read,
    touching no object in `state` (shapes and placements come from `live`)."""
    # The plan makes ~10^5 small objects (the JSON of manifest, index, header and skeleton), none
    # in a reference cycle: with the cyclic GC on, every few plans a full collection walked the
    # training process's whole heap (7B at 1,024 ranks: ~55 ms of CPU, every third plan ~210 ms).
    with gc_paused():
        return _plan_part(rank, choice, state, live, strict)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC off for the block (back on after it, if it was on)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def _plan_part(rank: int, choice: RestoreChoice, state: MutableMapping[str, Any], live: dict[str, Any],
               strict: bool) -> Part | Failure:
    # Rank r reads shard r; on a larger world, rank r >= W reads shard r % W (restoreapply.apply_loaded:
    # its RNG). Replicated tensors are read from shard 0, unless this rank's own shard holds them too
    # (small ones: replicas.everywhere; then no second shard is opened). DTensor pieces
    # are read by box from whichever shards hold this rank's new region (reshard).
    src = rank if rank < choice.world_size else rank % choice.world_size
    keys = list(state)
    directory = Path(choice.path)
    opened = OpenShards(directory)
    try:
        # Every byte read is checked against the digests the manifest recorded at save time
        # (hashing while reading). Rank 0 parsed the manifest when it chose; every other rank
        # parsed the bytes rank 0 sent (`with_manifest`), or, given a choice without them, reads
        # the file here, once, checked against the digest rank 0 read (pinned by the marker).
        manifest = choice.manifest or read_pinned(directory, choice.step, choice.manifest_xxh3)
        shard, first = manifest.shards[src], manifest.shards[0]
        sharded = manifest.sharded if manifest.placed_by_arithmetic else from_json(choice.sharded)
        header = opened.header(shard["file"], shard["bytes"], manifest.expected(src))
        meta = header.get("__metadata__")
        raw = meta.get(SKELETON_KEY, "") if isinstance(meta, dict) else ""
        skeleton = loads_skeleton(raw, f"skeleton of {shard['file']}")  # its DTensor specs parsed if read
        names = header.keys() - sharded.keys() - {"__metadata__"}  # set operations in C (3,411 names at 405B)
        listed = skeleton.get("replicated") or [] if isinstance(skeleton, dict) else []
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise CorruptCheckpointError(f"skeleton of {shard['file']}: 'replicated' is not a list of names")
        shared = set(listed).difference(names, sharded)
        infos = {n: header[n] for n in names}
        if shared:
            header0 = opened.header(first["file"], first["bytes"], manifest.expected(0))
            infos.update({n: header0[n] for n in header0 if n in shared})
        # once (not again to decode); of the DTensor specs only what the restore reads (boxes.targets)
        refs = validate_skeleton(keys, skeleton, infos.keys() | sharded.keys(), strict, specs=False)
        # Shapes from the headers (a DTensor: its global shape), as meta tensors: a checkpoint
        # that does not fit the live modules and optimizers is refused before any byte is loaded
        # (the other entries are decoded, and checked, by the read, before anything is applied).
        fits = [k for k in keys if is_stateful(state[k])]
        check_fits(state, decode_entries(fits, skeleton, MetaOnDemand(infos, sharded), strict, checked=True)[0])
        if not skeleton["entries"].keys() <= set(keys):  # (else every entry's: the names validated)
            refs = referenced(skeleton, keys)
        wanted = {n: sharded[n] for n in refs if n in sharded}
        where = reshard_targets(state, live, wanted, skeleton.get("dtensors") or {})
        boxes, sources, boxed = plan_reads(wanted, where)
        if not manifest.placed_by_arithmetic:  # pieces the specs do not place: their indexes, checked first
            for r in sorted({src} | sources):
                manifest.rank_tensors(r)
        # Placed by arithmetic, each piece's box is the specs' (boxes.plan_reads), each shard's
        # header is checked against the manifest's digest when first opened, and carries the block
        # digests of the tensors it holds (shard.FINE_KEY, BLOCKS_KEY): no index file is opened,
        # unless a tensor's digests are only there (an older checkpoint, a shard of large plain
        # tensors), and then by the read that needs them (Expected.of), before anything is applied.
        staging = sum(int(i["data_offsets"][1]) - int(i["data_offsets"][0]) for i in infos.values())
        return Part(directory, shard, first, manifest, src, skeleton, names, shared & set(infos), wanted, where,
                    boxes, staging + boxed, opened, frozenset(sources))
    except CheckpointError as exc:
        opened.close()
        return Failure.of(exc)


def read_part(rank: int, choice: RestoreChoice, part: Part | Failure, keys: list[str], live: dict[str, Any],
              strict: bool, mode: str = "stage", exchanged: Any = None) -> Loaded:
    """Every rank: read, verify and decode its planned part. `mode` "stage": into fresh memory,
    touching nothing in `state`; "verify": check every byte, keep nothing, decode nothing;
    "live": straight into the live tensors where they fit (a restore too large to stage, after
    every rank's "verify" pass succeeded). `exchanged` (group, exchange.Plan), when every rank
    agreed on one: the DTensor boxes come from `exchange.load` (collective), run first, before
    anything that could fail on this rank alone."""
    if isinstance(part, Failure):
        return Loaded(failure=part)
    d, shard, first, m = part.directory, part.shard, part.first, part.manifest
    try:
        before = dict(RESHARD_STATS)
        boxes = exchange.load(exchanged[0], exchanged[1], d, m.shards, part.wanted, part.where, m.expected, mode,
                              part.opened, part.boxes) if exchanged is not None and part.wanted else None
        if mode == "verify":
            whole = verify_tensors(d, shard["file"], shard["bytes"], part.names - part.shared, m.expected(part.src),
                                   part.opened)
            whole += verify_tensors(d, first["file"], first["bytes"], part.shared, m.expected(0),
                                    part.opened) if part.shared else 0
            if part.wanted and boxes is None:
                load_sharded(d, m.shards, part.wanted, part.where, m.expected, mode, part.opened, part.boxes)
            return Loaded(read=whole + RESHARD_STATS["bytes"] - before["bytes"], needed=0)
        plain = {n: t for n, t in live.items() if n not in part.wanted and not is_dtensor(t)} if mode == "live" else None
        tensors, _, _ = load_tensors(d, shard["file"], shard["bytes"], plain, names=part.names - part.shared,
                                     expect=m.expected(part.src), opened=part.opened)
        if part.shared:
            more, _, _ = load_tensors(d, first["file"], first["bytes"], plain, names=part.shared,
                                      expect=m.expected(0), opened=part.opened)
            tensors.update(more)
        whole = sum(t.numel() * t.element_size() for t in tensors.values())  # read whole: read == needed
        if boxes is not None:
            tensors.update(boxes)
        elif part.wanted:
            tensors.update(load_sharded(d, m.shards, part.wanted, part.where, m.expected, mode, part.opened, part.boxes))
        read = whole + RESHARD_STATS["bytes"] - before["bytes"]
        needed = whole + RESHARD_STATS["needed"] - before["needed"]
        # the skeleton as plan_part validated it for these keys (its DTensor specs: where read)
        decoded, library = decode_entries(keys, part.skeleton, tensors, strict, checked=True)
        if rank < choice.world_size and isinstance(library, dict) and "rng" in library:
            rng.validate(library["rng"])  # before restoreapply.apply_loaded touches anything
        return Loaded(decoded, library, None, read, needed)
    except CheckpointError as exc:
        return Loaded(failure=Failure.of(exc))


def staging_budget(override: str | None, mem_available: int | None, local_ranks: int) -> int | None:
    """Bytes one rank may stage for a restore (None: no limit): `override` (the environment's
    SLURMRESUME_RESTORE_STAGING_BYTES), else half the node's available memory shared by its
    ranks, else (memory unknown) no limit. Pure."""
    if override is not None and override.strip():
        if not override.strip().isdigit():
            raise ConfigError(f"{ENV_RESTORE_STAGING}={override!r} is not a number of bytes: "
                              f"unset it, or give e.g. {ENV_RESTORE_STAGING}=0 to never stage")
        return int(override)
    if mem_available is None:
        return None
    return mem_available // (2 * max(local_ranks, 1))

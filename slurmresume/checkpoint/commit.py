"""How a step becomes durable: prepare (rank 0), write shards (all ranks), commit (rank 0).

A save only ever writes into, renames or deletes a directory it created itself: rank 0 creates a
private `.saving.step_N.<token>/` (unique per save), every rank writes into that one, and the
commit makes it `step_N` in one rename that cannot replace another writer's directory (a
non-empty target makes the rename fail). Two writers of the same step in one root can therefore
both fail or one lose, but neither can destroy a committed step.

Durability order (DESIGN.md section 1):
  1. rank 0: mkdir `.saving.step_N.<token>/` and its `.inprogress` note (leftovers.note);
     fsync the root. The directory's name is broadcast. No lock: nothing shared is touched.
  2. every rank: its shard, then its tensor index (format 2, `rankindex`), each to a temp name in
     that directory, fsync, rename (no directory fsync: rank 0's, in step 4 before the marker,
     covers every rank's renames). The index is written and fsynced while the shard's fsync
     runs (on another thread); the shard is renamed after both fsyncs returned.
  3. all ranks report a fixed-size record (sizes, checksums of shard, header and index) to rank 0.
  4. rank 0: manifest.json (temp, fsync, rename), COMMITTED (temp, fsync, rename), drop
     `.inprogress`, fsync the directory; then publish: rename it to `step_N`, fsync the root.
     Only when `step_N` already exists and is not a complete checkpoint (a corrupt one, or a
     partial one left by an older version) is the root lock taken, with a short timeout, to move
     that directory aside first. The outcome is broadcast, so no rank returns "saved" before the
     published directory is durable.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from ..errors import SaveError
from . import fsio, leftovers, nodefile
from .collective import Group
from .jsonenc import dumps
from .layout import (
    DELETING_PREFIX,
    INPROGRESS,
    LOCK,
    MANIFEST,
    MARKER,
    parse_saving_dir,
    replaced_dir_name,
    saving_dir_name,
    shard_name,
    step_dir_name,
)
from .manifest import build_manifest, marker_bytes, over_cap
from .rankindex import placed, write_index
from .replicas import LIBRARY_PREFIX, everywhere
from .reports import PrepareDecision, SaveOutcome, WriteReport
from .shard import SKELETON_KEY, write_shard
from .store import inspect_dir

log = logging.getLogger("slurmresume")

LOCK_TIMEOUT = 120.0
REPLACE_LOCK_TIMEOUT = 10.0  # a commit waits at most this long to replace a corrupt step_N
BRIEF_LOCK_TIMEOUT = 2.0  # a save's own directory operations wait at most this long for the lock
BUSY_MEMORY_S = 60.0  # after a lock was found stuck, saves on that root try it once, without waiting
_BUSY: dict[str, float] = {}  # root -> when its lock was last found stuck (monotonic)


def root_lock(root: Path, timeout: float = LOCK_TIMEOUT) -> FileLock:
    # filelock chmods the file to exactly `mode`: take the umask off, as for every other file
    return FileLock(str(root / LOCK), timeout=timeout, mode=0o644 & ~fsio.umask())


def hide(path: Path, label: str = "aside") -> Path:
    """Make a directory invisible in one rename (to a unique `.deleting.*` name); returns it."""
    hidden = path.with_name(f"{DELETING_PREFIX}{path.name}.{uuid.uuid4().hex[:8]}")
    fsio.rename(path, hidden, f"delete.{label}")
    fsio.fsync_dir(path.parent, f"delete.{label}")
    return hidden


def move_aside(path: Path, label: str = "aside") -> None:
    """Make a step directory invisible in one rename, then delete its files (crash-safe)."""
    shutil.rmtree(hide(path, label), ignore_errors=True)


def prepare(root: Path, step: int, replace: bool = False) -> PrepareDecision:
    """Rank 0. Returns "write" into `dir` (this save's private directory under root, `replace` as
    asked), "skip" or "error" (reports.PrepareDecision); never raises. With `replace`, a
    complete committed step is not skipped: this save is written beside it and `commit` swaps
    it in once it is committed itself (the step is never without a complete checkpoint)."""
    d = root / step_dir_name(step)
    mine: Path | None = None
    try:
        fsio.makedirs(root, 0o755)
        if (d / MARKER).exists():
            info = inspect_dir(step, d)  # manifest + sizes; a corrupt one is replaced at the commit
            if info.unreadable:
                return PrepareDecision("error", error=_not_replaced(step, d, info.problem))
            if info.complete and not replace:
                return PrepareDecision("skip")  # step_N is a complete checkpoint already
            if not info.complete:
                log.warning("%s is committed but unusable (%s): this save will replace it", d, info.problem)
        mine = root / saving_dir_name(step, uuid.uuid4().hex[:16])
        # Directory and note appear together for a prune that holds the root lock (it re-checks
        # each victim under it, for its renames only): a save directory is never seen without
        # the note that protects it. A lock that stays busy is not waited on for long.
        with _lock_briefly(root):
            mine.mkdir(mode=0o755)  # fails if it exists: the name is this save's alone
            fsio.write_durable(mine / INPROGRESS, leftovers.note(), "inprogress")  # who: leftovers.py
        fsio.fsync_dir(root, "root")
        return PrepareDecision("write", mine.name, replace)
    except Exception as exc:
        error = _describe(exc, root)  # before the clean-up frees space or inodes
        if mine is not None:
            discard(mine)
        return PrepareDecision("error", error=error)


@contextmanager
def _lock_briefly(root: Path) -> Iterator[bool]:
    """The root lock for a few file operations; yields whether it is held. A prune holds it only
    for its renames (milliseconds), so a lock busy for BRIEF_LOCK_TIMEOUT is stuck (a hung
    holder, a node-local flock on NFS): the save goes on without it, and for BUSY_MEMORY_S the
    next attempts on this root try once instead of waiting again, so that neither the commit of
    the same save nor the next saves pay that wait twice. Without the lock, prune's age
    threshold (young_threshold) is what protects a save directory."""
    key = str(root)
    recently = time.monotonic() - _BUSY.get(key, float("-inf")) < BUSY_MEMORY_S
    lock = root_lock(root, 0 if recently else BRIEF_LOCK_TIMEOUT)
    try:
        lock.acquire()
    except Timeout:
        if not recently:
            log.warning("the root lock %s is busy for over %.0f s: saving without it", root / LOCK,
                        BRIEF_LOCK_TIMEOUT)
        _BUSY[key] = time.monotonic()
        yield False
        return
    _BUSY.pop(key, None)
    try:
        yield True
    finally:
        lock.release()


def _own_dir(root: Path, step: int, name: str) -> Path:
    if parse_saving_dir(name) != step:
        raise ValueError(f"{name!r} is not a save directory of step {step}")
    return root / name


def write_rank(root: Path, step: int, group: Group, skeleton: dict[str, Any], tensors: list[Any],
               replicated: set[str] | None = None, *, into: str) -> WriteReport:
    """Every rank: write its shard into `into` (the directory named by rank 0's prepare).
    Returns its report (reports.WriteReport); errors are reported, not raised, so that every rank still reaches the
    gather and nobody deadlocks. Tensors in `replicated` are written by rank 0 only (the
    skeleton lists them, so other ranks read them from shard 0), except the small plain ones,
    which every rank writes too (`replicas.everywhere`: a restoring rank opens its own shard only)."""
    if replicated:
        skeleton = {**skeleton, "replicated": sorted(replicated)}
        if group.rank != 0:
            kept = everywhere(replicated, tensors, skeleton.get("dtensors") or {})
            tensors = [(n, t) for n, t in tensors if n not in replicated or n in kept]
    file = shard_name(group.rank, group.world_size)
    d = root / into
    try:
        d = _own_dir(root, step, into)
        fsio.makedirs(d, 0o755)
        # No directory fsync here: W ranks fsyncing one shared directory are W metadata operations
        # on one server. Rank 0's fsync of it (with the manifest, after every rank reported its
        # rename) makes every shard's name durable before the marker is written.
        metadata = {SKELETON_KEY: dumps(skeleton), "format": "pt"}
        specs = skeleton.get("dtensors") or {}
        if nodefile.layout_from_env() == "per-node":  # the node's ranks share one file (nodefile)
            written, own = nodefile.write_node_shard(d, nodefile.link_for(group), group.rank, tensors, metadata,
                                                     specs)
            file, index = written.file, written.tensors
        else:
            own = {}

            def index_file(entries: dict[str, Any]) -> None:  # written while the shard's fsync runs
                own.update(write_index(d, group.rank, file, placed(entries, specs)))

            written = write_shard(d, file, tensors, metadata, beside=index_file)
            index = placed(written.tensors, specs)  # where each DTensor piece sits in its global tensor
        mine = group.rank == 0  # what the manifest lists once per tensor: rank 0 knows it, nobody sends it
        return WriteReport(
            group.rank, file, written.bytes, written.xxh3, written.header_xxh3, own["index"], own["index_bytes"],
            own["index_xxh3"], pins_world(index, specs, replicated or set()), None, written.writer,
            sharded={n: {"dtype": index[n]["dtype"], "shape": sp["shape"], "placements": sp["placements"],
                         "mesh_shape": sp.get("mesh_shape"), "mesh_arange": bool(sp.get("mesh_arange"))}
                     for n, sp in specs.items() if n in index} if mine else {},
            replicated=tuple(sorted(replicated or ())) if mine else (), timing=written.timing,
            listed=unplaced(index, specs, group.world_size))
    except Exception as exc:
        error = _describe(exc, d / file)  # before the clean-up frees space or inodes
        _cleanup_temp(d, file)
        return WriteReport(group.rank, file, error=error)


def unplaced(index: dict[str, Any], dtensors: dict[str, Any], world: int) -> bool:
    """Pure: whether this rank holds a DTensor piece that the placements over every rank do not
    give (a mesh over some ranks only, e.g. a pipeline stage's, which rank 0 may not even hold):
    then the restore finds every piece in the index files, never by arithmetic."""
    from .placement import arithmetic

    return any(n in index and not arithmetic(sp, world) for n, sp in dtensors.items())


def pins_world(index: dict[str, Any], dtensors: dict[str, Any], replicated: set[str]) -> bool:
    """Pure: whether a rank's tensors include a genuinely per-rank plain tensor, which only a run
    of the same world size can load (replicas, DTensor pieces and the library's RNG do not)."""
    return any(n not in replicated and n not in dtensors and not n.startswith(LIBRARY_PREFIX) for n in index)


def commit(root: Path, step: int, reports: list[WriteReport], metrics: Any, meta: Any, *, into: str,
           replace: bool = False) -> SaveOutcome:
    """Rank 0: manifest (every rank's report in it as JSON, `build_manifest`), then the marker,
    then publish `into` as step_N (`commit_bytes`). Returns whether `path` is published (reports.SaveOutcome). On failure this save's directory is removed and nothing of
    it is visible; nothing else is touched."""
    mine = _own_dir(root, step, into)
    errors = [r.error for r in reports if r.error]
    if errors:
        discard(mine)
        return SaveOutcome(False, error=errors[0])
    try:
        manifest = build_manifest(step, [r.to_json() for r in reports], metrics, meta)
        raw = dumps(manifest).encode()
        marker = marker_bytes(step, raw, manifest)
        # A commit is a promise that the step loads: every read cap is checked before the marker.
        per_rank = len(manifest["sharded"]) + len(manifest["replicated"])
        refusal = over_cap(step, len(raw), len(marker), len(reports), per_rank)
        if refusal is not None:
            raise SaveError(refusal)
    except Exception as exc:
        error = _describe(exc, mine)  # before the clean-up frees space
        discard(mine)
        return SaveOutcome(False, error=error)
    return commit_bytes(root, step, raw, marker, into=into, replace=replace)


def commit_bytes(root: Path, step: int, raw: bytes, marker: bytes, *, into: str, replace: bool = False) -> SaveOutcome:
    """The end of every commit, once the shards are in `into` (prepared by `prepare`): the manifest
    `raw`, then the marker, durable, the note removed and the directory published as step_N under
    the root lock. Also the commit of a memory snapshot copied whole to this root (job/promote.py:
    its manifest and marker are rank 0's, byte for byte). On failure `into` is removed and nothing
    of it is visible; nothing else is touched."""
    mine = _own_dir(root, step, into)
    target = root / step_dir_name(step)
    published = False
    try:
        fsio.write_durable(mine / MANIFEST, raw, "manifest")
        fsio.write_durable(mine / MARKER, marker, "marker")
        # The note goes and the directory is published under the root lock: a prune (which
        # re-checks its victims under it) never sees this directory without its note unpublished.
        with _lock_briefly(root) as held:
            fsio.unlink(mine / INPROGRESS, "inprogress")
            fsio.fsync_dir(mine, "step")
            how = _publish(root, mine, target, replace, held)
            published = True
        if how != "swapped":  # a swap made itself durable before it removed the old checkpoint
            fsio.fsync_dir(root, "root")
        return SaveOutcome(True, str(target))
    except Exception as exc:
        error = _describe(exc, target if published else mine)  # before the clean-up frees space
        if published:
            # The rename happened but is not durable. The directory is ours, published a moment
            # ago: take the marker back first (nobody may count a step the caller is told
            # failed), then take the directory back under its private name and remove it, so
            # that its bytes do not hold the space the next save needs.
            fsio._unlink_quiet(target / MARKER)
            try:
                os.rename(target, mine)
            except OSError:
                return SaveOutcome(False, error=error)
        discard(mine)
        return SaveOutcome(False, error=error)


def _publish(root: Path, mine: Path, target: Path, replace: bool = False, held: bool = False) -> str:
    """Rename `mine` to `target`. A rename onto a non-empty directory fails (ENOTEMPTY/EEXIST),
    so another writer's published step is never replaced. Only a target that is not a complete
    checkpoint is moved aside, re-checked under the root lock (short timeout) right before.
    Returns "published", or "swapped" when a complete step was replaced (`_swap_in`)."""
    if not os.path.lexists(target):
        try:
            fsio.rename(mine, target, "publish")
            return "published"
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
    step = int(target.name.removeprefix("step_"))
    try:
        with nullcontext() if held else root_lock(root, REPLACE_LOCK_TIMEOUT):
            if os.path.lexists(target):
                info = inspect_dir(step, target)
                if info.complete and replace:  # an explicit final save whose state changed
                    _swap_in(mine, target, root)
                    return "swapped"
                if info.complete:
                    raise SaveError(f"step {step} was committed at {target} by another writer while this save "
                                    "ran; this save's copy is discarded (two runs share this checkpoint root?)")
                if info.unreadable:
                    raise SaveError(_not_replaced(step, target, info.problem))
                log.warning("replacing %s: %s", target, info.problem)
                hidden = hide(target, "stale")
            else:
                hidden = None
            fsio.rename(mine, target, "publish")
    except Timeout:
        raise SaveError(f"cannot replace the unusable {target}: the root lock {root / LOCK} is held for over "
                        f"{REPLACE_LOCK_TIMEOUT:.0f} s (a prune?)") from None
    if hidden is not None:
        shutil.rmtree(hidden, ignore_errors=True)
    return "published"


def _not_replaced(step: int, path: Path, problem: str | None) -> str:
    return (f"step {step} is already committed at {path} in a form this version cannot read ({problem}); "
            "it is not replaced: upgrade slurmresume, or save into another --ckpt-dir")


def discard(d: Path) -> None:
    """Remove this save's own private directory after a failure (best effort): its files must not
    keep holding disk space (on a full disk they would make the next save fail too)."""
    if parse_saving_dir(d.name) is None:
        raise ValueError(f"refusing to discard {d}: not a save directory")
    for name in (MARKER, MANIFEST):
        fsio._unlink_quiet(d / name)
    shutil.rmtree(d, ignore_errors=True)


def _cleanup_temp(d: Path, file: str) -> None:
    try:
        for p in d.glob(f".{file}.tmp.*"):
            p.unlink()
    except OSError:
        pass


def _describe(exc: BaseException, path: Path) -> str:
    """One line: what failed, on which file, and (disk full) how much space is free and needed."""
    import errno

    if isinstance(exc, SaveError):
        return str(exc)
    where = Path(getattr(exc, "slurmresume_path", None) or path)
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        needed = getattr(exc, "slurmresume_needed", None)
        free, inodes = getattr(exc, "slurmresume_free", None) or fsio.free_space(where)
        what = "no space left on device" if exc.errno == errno.ENOSPC else "disk quota exceeded"
        need = f", {needed} bytes needed" if needed is not None else ""
        ino = "; no free inodes left (the file system ran out of files, not bytes)" if inodes == 0 else ""
        return (f"{what} while writing {where} ({free} bytes free{need}{ino}): "
                "free space or point the checkpoint root elsewhere")
    if isinstance(exc, OSError) and exc.errno == errno.ELOOP and Path(exc.filename or "").name == LOCK:
        return (f"lock file {exc.filename} is a symbolic link: refusing to follow it; inspect it, remove it "
                f"(rm {exc.filename}) and retry")
    if isinstance(exc, PermissionError):
        return f"permission denied writing {where}: make the checkpoint root writable or choose another"
    return f"{type(exc).__name__} while writing {where}: {exc}"


def raise_if_failed(outcome: SaveOutcome) -> None:
    if not outcome.ok:
        raise SaveError(f"checkpoint save failed, nothing committed: {outcome.error}")


def _swap_in(staged: Path, final: Path, root: Path) -> None:
    """Rank 0, under the root lock: the committed `staged` directory takes the name of the
    complete step directory `final`; crash-safe without RENAME_EXCHANGE too (replace.py says how,
    and how `replace.finish` settles a replace that a kill interrupted). A failure before the commit
    point leaves `final` the old copy; raises OSError."""
    if fsio.exchange(staged, final, "replace"):
        fsio.fsync_dir(root, "root")
        move_aside(staged, "replaced")  # now holds the old checkpoint
        return
    parked = root / replaced_dir_name(staged.name)
    fsio.rename(final, parked, "replace.park")
    try:
        fsio.rename(staged, final, "replace.publish")
    except BaseException:
        fsio.rename(parked, final, "replace.back")  # the old checkpoint goes back in place
        raise
    fsio.fsync_dir(root, "root")
    move_aside(parked, "replaced")

"""Names on disk: the one place that knows how directories and files are called.

<root>/
  step_000001200/
    rank-00000-of-00002.safetensors
    rank-00000.index.json   format 2+: this rank's tensor index (names, shapes, block digests),
                       written and fsynced with its shard; manifest.json records its digest
    manifest.json
    COMMITTED          written last; its presence is what makes the step usable
  .saving.step_000001400.<hex>/   a save in progress: private to the one save that created it;
                       its commit renames it to step_000001400 (never seen half-written)
  .replaced.step_000001400.<hex>/ the old copy of a committed step while a final save replaces
                       it without RENAME_EXCHANGE (checkpoint/replace.py); no clean-up touches it
  events.jsonl         append-only event log
  .slurmresume.lock    filelock guarding the replacement of a corrupt step and retention renames
  .owner.json          the lease of the run that owns this root (ownership.py)
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..errors import ConfigError

FORMAT = "slurmresume/3"  # the manifest format this version writes
# ... and those it reads (1: one manifest lists every tensor; 2: per-rank index files, the shard
# table as one object per shard; 3: the same table as columns, shardtable.py)
FORMATS_READ = ("slurmresume/1", "slurmresume/2", "slurmresume/3")
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
INPROGRESS = ".inprogress"
EVENTS = "events.jsonl"
LOCK = ".slurmresume.lock"
DELETING_PREFIX = ".deleting."
SAVING_PREFIX = ".saving."
OWNER = ".owner.json"
OWNER_LOCK = ".owner.json.lock"
# A committed step being replaced (a final save whose state changed since a periodic save of the
# same step) is written and committed in its own `.saving.` directory, then swapped in; where the
# file system has no RENAME_EXCHANGE the old copy waits under "<REPLACED_PREFIX><step dir>.<hex>"
# (the hex of the save that replaces it) until the new one holds the step's name (replace.py).
# Deliberately not a prefix that leftovers.py or retention's `.deleting.` clean-up knows.
REPLACED_PREFIX = ".replaced."
STEP_DIGITS = 9

# ASCII digits and fullmatch: `\d` also matches other scripts' digits (which int() accepts) and
# `$` matches before a trailing newline, so "step_000000005\n" would pass as step 5.
_STEP_RE = re.compile(rf"step_([0-9]{{{STEP_DIGITS},}})")
_SAVING_RE = re.compile(rf"\.saving\.step_([0-9]{{{STEP_DIGITS},}})\.([0-9a-f]{{16}})")
_REPLACED_RE = re.compile(rf"\.replaced\.step_([0-9]{{{STEP_DIGITS},}})\.([0-9a-f]{{16}})")
_SHARD_RE = re.compile(r"rank-([0-9]{5})-of-([0-9]{5})\.safetensors")
_INDEX_RE = re.compile(r"rank-([0-9]{5,})\.index\.json")
# per-node layout (`nodefile`): one file per node, named by the node's first rank; a rank's shard
# and its index are ranges "node-NNNNN.bin@OFFSET" of it (the manifest records their lengths)
_NODE_RE = re.compile(r"node-([0-9]{5,})\.bin")
_NODE_RANGE_RE = re.compile(r"node-([0-9]{5,})\.bin@(0|[1-9][0-9]{0,18})")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step_{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a directory name, or None when the name is not a step directory."""
    m = _STEP_RE.fullmatch(name)
    if not m:
        return None
    step = int(m.group(1))
    return step if step_dir_name(step) == name else None  # one name per step: no "step_0000000005"


def enclosing_step_dir(path: Path) -> Path | None:
    """The committed (or committing) step folder that `path` is, or lies under, else None: a
    folder named like one that holds a manifest or a commit marker (names alone are no evidence:
    a root may be called step_000000001). Its parent is the root the step belongs to. Reads only
    the markers of `path` and its parents, as given and with links resolved (`latest` prints a
    step folder; a script that uses it as its root must not write step folders inside it)."""
    seen: set[Path] = set()
    for start in (path.absolute(), path.resolve()):
        for folder in (start, *start.parents):
            if folder in seen or parse_step_dir(folder.name) is None:
                continue
            seen.add(folder)
            if os.path.lexists(folder / MANIFEST) or os.path.lexists(folder / MARKER):
                return folder
    return None


def refuse_step_dir(root: Path, command: str | None = None, flag: str = "-d") -> None:
    """ConfigError naming the root when `root` is a step folder (what `latest` prints) or lies
    under one: a command would otherwise find no checkpoint there, or write into a saved one.
    `flag`: how `command` spells the root (`submit`: --ckpt-dir)."""
    import shlex

    step = enclosing_step_dir(root)
    if step is None:
        return
    run = f"slurmresume {command} " if command else ""
    what = ("is a step folder, not a checkpoint root: use its parent" if step == root else
            f"is inside the step folder {step}, not a checkpoint root: use the root that holds it")
    raise ConfigError(f"{root} {what}: {run}{flag} {shlex.quote(str(step.parent))}")


def saving_dir_name(step: int, token: str) -> str:
    """The private directory one save writes into (token: 16 hex digits, unique per save)."""
    return f"{SAVING_PREFIX}{step_dir_name(step)}.{token}"


def parse_saving_dir(name: object) -> int | None:
    """The step of an in-progress save directory name, or None (also for anything with a path part)."""
    m = _SAVING_RE.fullmatch(name) if isinstance(name, str) else None
    return parse_step_dir(f"step_{m.group(1)}") if m else None


def saving_token(name: str) -> str | None:
    """The token of a save directory's name (what `saving_dir_name` was given), or None."""
    m = _SAVING_RE.fullmatch(name)
    return m.group(2) if m and parse_saving_dir(name) is not None else None


def replaced_dir_name(saving: str) -> str:
    """Where the old copy of a step waits while the save in `saving` (a `saving_dir_name`)
    replaces it: same step, same token."""
    step, token = parse_saving_dir(saving), saving_token(saving)
    if step is None or token is None:
        raise ValueError(f"{saving!r} is not a save directory name")
    return f"{REPLACED_PREFIX}{step_dir_name(step)}.{token}"


def parse_replaced_dir(name: str) -> int | None:
    """The step of a parked old copy's name (`replaced_dir_name`), or None."""
    m = _REPLACED_RE.fullmatch(name)
    return parse_step_dir(f"step_{m.group(1)}") if m else None


def saving_dirs(root: Path) -> list[tuple[int, Path]]:
    """In-progress (or abandoned) save directories under root, newest step first."""
    try:
        entries = [e for e in root.iterdir() if e.name.startswith(SAVING_PREFIX)]
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    found = [(step, e) for e in entries if (step := parse_saving_dir(e.name)) is not None]
    found.sort(key=lambda item: (item[0], item[1].name), reverse=True)
    return found


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def is_plain_shard_name(name: object) -> bool:
    """True for a manifest file name we are willing to open: no path parts, our pattern (a rank's
    own file, or its range of a node file)."""
    return isinstance(name, str) and (_SHARD_RE.fullmatch(name) is not None
                                      or _NODE_RANGE_RE.fullmatch(name) is not None)


def node_file_name(first_rank: int) -> str:
    """The per-node layout's one data file of the node whose first rank is `first_rank`."""
    return f"node-{first_rank:05d}.bin"


def is_node_file_name(name: object) -> bool:
    return isinstance(name, str) and _NODE_RE.fullmatch(name) is not None


def index_name(rank: int) -> str:
    """Rank `rank`'s tensor index file (format 2)."""
    return f"rank-{rank:05d}.index.json"


def is_plain_step_file(name: object) -> bool:
    """A shard or an index file name: the files of a step a reader or the mirror opens by name."""
    return is_plain_shard_name(name) or (isinstance(name, str) and _INDEX_RE.fullmatch(name) is not None)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """All step directories under root, newest (highest step) first. No marker check."""
    found: list[tuple[int, Path]] = []
    try:
        entries = list(root.iterdir())
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        raise ConfigError(f"checkpoint root {root} is not a directory (it or a parent is a file): "
                          "choose a directory path") from None
    except PermissionError:
        raise ConfigError(f"checkpoint root {root} cannot be listed: permission denied") from None
    for entry in entries:
        step = parse_step_dir(entry.name)
        if step is not None:
            found.append((step, entry))
    found.sort(key=lambda item: item[0], reverse=True)
    return found

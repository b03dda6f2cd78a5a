"""A `Checkpointer`'s side of the root's lease (`ownership.py`): under the launcher, check that
the lease names this run; bare, take it (once per root and process, shared by the process's open
Checkpointers), also when the first save creates the root; before every save, refuse when this
run no longer owns the root. Rank 0 only; `roots.claim_root` makes it collective.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..ownership import Holder, RootOwnedError, acquire, lease_path, read_lease, slurm_owner

log = logging.getLogger("slurmresume")


@dataclass
class _Claim:
    """This process's lease on one root, shared by its open Checkpointers."""

    holder: Holder
    users: int  # open Checkpointers counting on it
    pid: int  # the process that took it (a forked child inherits the entry, not the lease)


_HELD: dict[tuple[str, str], _Claim] = {}  # (root, owner) -> claim
_HELD_LOCK = threading.Lock()
_LOCAL_OWNER: str | None = None  # this process's owner id when bare (`_local_owner`)


def for_checkpointer(root: Path, *, creating: bool = False) -> tuple[str, str] | None:
    """Rank 0 of a `Checkpointer`. Under the launcher ($SLURMRESUME_OWNER set): check that the
    lease names this run. Bare (no launcher): take the lease for this Slurm job, or this process,
    taking over an owner that is provably gone (weak evidence only with $SLURMRESUME_TAKEOVER=1);
    one heartbeat per root and process, shared by the process's open Checkpointers. A root that
    does not exist yet is leased when it is created (`creating`, from `before_save`): restoring
    never creates it. Returns the key to hand to `unclaim` when the Checkpointer closes (None:
    nothing taken). Raises RootOwnedError when another run owns the root."""
    from ..contract import ENV_OWNER, ENV_TAKEOVER

    mine = os.environ.get(ENV_OWNER)
    if mine:
        _check_names(root, mine)
        return None
    if not creating and not Path(root).is_dir():
        return None
    job = os.environ.get("SLURM_JOB_ID")
    owner = slurm_owner(job) if job else _local_owner()
    key = (str(Path(root).absolute()), owner)
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None and not held.holder.lost and _names(root, owner):
            held.users += 1
            return key
        try:  # a first claim, or one whose lease is gone (the root was wiped) or was taken
            acquire(root, owner, takeover=os.environ.get(ENV_TAKEOVER) == "1",
                    hint=f"set {ENV_TAKEOVER}=1 (or use `slurmresume submit --takeover`)")
        except OSError as exc:  # a read-only root can still be restored from; saves will say why they fail
            log.warning("cannot write the lease %s (%s): continuing without one", lease_path(root), exc)
            return None
        if held is None or held.pid != os.getpid():
            _HELD[key] = _Claim(Holder(root, owner), 1, os.getpid())
        else:  # leased again: a fresh heartbeat for every open Checkpointer, and they still count
            held.holder.stop()
            held.holder, held.users = Holder(root, owner), held.users + 1
        return key


def _local_owner() -> str:
    """This process's owner id: host name and pid for people, and a random part that makes it
    this process's alone (two containers on one host share the host name and hand out the same
    pids). Drawn once per process; a forked child draws its own."""
    global _LOCAL_OWNER
    if _LOCAL_OWNER is None:
        _LOCAL_OWNER = f"local-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    return _LOCAL_OWNER


def _forget_owner() -> None:
    global _LOCAL_OWNER
    _LOCAL_OWNER = None


os.register_at_fork(after_in_child=_forget_owner)


def _names(root: Path, owner: str) -> bool:
    current = read_lease(root)
    return current is not None and current.owner == owner


def _check_names(root: Path, mine: str) -> None:
    current = read_lease(root)
    if current is not None and current.owner != mine:
        raise RootOwnedError(f"checkpoint root {root} is owned by {current.describe()}, not by this run "
                             f"({mine}): refusing to write into it")


def before_save(root: Path, key: tuple[str, str] | None) -> tuple[str, str] | None:
    """Rank 0 of a `Checkpointer`, before each save. Raises RootOwnedError (one line) when this
    run no longer owns the root: a holder that lost its lease stops, it never commits into a root
    another run owns. A bare Checkpointer that holds no lease yet (its root did not exist) takes
    it now, as this save creates the root. Returns the key to keep (see `for_checkpointer`)."""
    from ..contract import ENV_OWNER

    mine = os.environ.get(ENV_OWNER)
    if mine:
        _check_names(root, mine)
        return key
    if key is None:
        return for_checkpointer(root, creating=True)
    held = _HELD.get(key)
    current = read_lease(root)
    if (held is not None and held.holder.lost) or (current is not None and current.owner != key[1]):
        now = current.describe() if current is not None and current.owner != key[1] else "another run"
        raise RootOwnedError(f"this run ({key[1]}) lost checkpoint root {root} to {now}: it stops here and "
                             "saves nothing more there")
    return key


def lost(key: tuple[str, str] | None) -> bool:
    """Whether the lease this process holds under `key` (`for_checkpointer`) was lost, as its
    heartbeat last saw. Local and cheap: `Checkpointer.step` asks it on rank 0 every step."""
    held = _HELD.get(key) if key is not None else None
    return held is not None and held.holder.lost


def unclaim(key: tuple[str, str] | None) -> None:
    """A Checkpointer that `for_checkpointer` counted closed: the last one of the process frees the
    root, so that a later run (or a forked child) on this root is not refused by a live process that
    no longer writes there."""
    if key is None:
        return
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is None or held.pid != os.getpid():  # a forked child never frees its parent's lease
            return
        held.users -= 1
        if held.users > 0:
            return
        del _HELD[key]
    held.holder.release()

"""One owner per checkpoint root: a lease file, `<root>/.owner.json`, that the run writing the
root holds and refreshes.

Why a lease and not a lock: `flock` is node-local on Lustre with `localflock` (and reportedly on
GPFS), and NFS may show a file late; a small JSON record, written atomically (temp, fsync,
rename, directory fsync) and refreshed by a heartbeat, is visible to every node. A filelock
(`.owner.json.lock`) guards the read-modify-write where it works; where it does not, the
heartbeat notices a lost lease (the file names someone else) and says so.

The record: owner id, kind ("slurm" | "local"), Slurm job id, pid, host, since (first taken),
heartbeat (last refreshed). Who is the same owner: every run of one Slurm job (requeues keep the
job id: owner "slurm-<job id>") and every restart of one `submit --local` (one launcher
process). Ranks under the launcher do not acquire: they check that the lease names their
launcher's run ($SLURMRESUME_OWNER).

When an owner is provably gone (`judge`):
  - a Slurm job no longer in `squeue` (or in an ended state);
  - a local run whose pid is dead (or reused: the process start time differs) on this host;
  - otherwise (another host, or `squeue` not answering), a heartbeat older than STALE_AFTER_S
    (10 minutes: 20 missed heartbeats of HEARTBEAT_S, far beyond NFS attribute caching).
A live owner is never taken over. `submit` takes over a gone owner only with `--takeover`; a bare
`Checkpointer` (no launcher, no flag to pass) takes over a gone owner by itself, logging it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .checkpoint.layout import OWNER, OWNER_LOCK
from .errors import ConfigError

log = logging.getLogger("slurmresume")

HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0
LOCK_WAIT_S = 10.0
MAX_LEASE_BYTES = 16 << 10
_ENDED = {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY",
          "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}


class RootOwnedError(ConfigError):
    """Another run owns the checkpoint root (or did, and --takeover was not given)."""


@dataclass(frozen=True)
class Lease:
    owner: str  # "slurm-<job id>" or "local-<pid>-<hex>"
    kind: str  # "slurm" | "local"
    job_id: str | None
    pid: int
    host: str
    since: float
    heartbeat: float
    pid_start: str = ""  # /proc/<pid>/stat start time: a reused pid is not the owner

    def describe(self) -> str:
        who = f"Slurm job {self.job_id}" if self.kind == "slurm" else f"local run pid {self.pid}"
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        return f"{who} on host {self.host} (since {since}, heartbeat {max(0, time.time() - self.heartbeat):.0f} s ago)"


def lease_path(root: Path) -> Path:
    return Path(root) / OWNER


def slurm_owner(job_id: str) -> str:
    return f"slurm-{job_id}"


def new_lease(owner: str, *, pid: int | None = None) -> Lease:
    """A lease for `owner` held by this process (kind and job id follow from the owner id)."""
    pid = os.getpid() if pid is None else pid
    kind = "slurm" if owner.startswith("slurm-") else "local"
    now = time.time()
    return Lease(owner, kind, owner.removeprefix("slurm-") if kind == "slurm" else None, pid,
                 socket.gethostname(), now, now, _start_time(pid))


def read_lease(root: Path) -> Lease | None:
    """The current lease, or None (no file, or unreadable: a torn or hostile file is ignored)."""
    try:
        fd = os.open(lease_path(root), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw: Any = json.loads(os.read(fd, MAX_LEASE_BYTES))
        return Lease(str(raw["owner"]), str(raw["kind"]), None if raw.get("job_id") is None else str(raw["job_id"]),
                     int(raw["pid"]), str(raw["host"]), float(raw["since"]), float(raw["heartbeat"]),
                     str(raw.get("pid_start") or ""))
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    finally:
        os.close(fd)


def _write(root: Path, lease: Lease) -> None:
    from .checkpoint.fsio import makedirs, write_durable

    makedirs(Path(root), 0o755)
    write_durable(lease_path(root), json.dumps(asdict(lease), separators=(",", ":")).encode(), "owner")


def _lock(root: Path) -> Any:
    from filelock import FileLock

    from .checkpoint.fsio import makedirs, umask

    makedirs(Path(root), 0o755)
    return FileLock(str(Path(root) / OWNER_LOCK), timeout=LOCK_WAIT_S, mode=0o644 & ~umask())


def _start_time(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


def judge(lease: Lease, now: float | None = None) -> tuple[bool, str]:
    """(gone?, why). Gone only when provably so; see the module docstring."""
    now = time.time() if now is None else now
    age = now - lease.heartbeat
    if lease.kind == "slurm" and lease.job_id:
        state = _squeue_state(lease.job_id)
        if state is not None:
            return (True, f"job {lease.job_id} has ended ({state or 'not in squeue'})") if (
                state == "" or state in _ENDED) else (False, f"job {lease.job_id} is {state}")
    elif lease.host == socket.gethostname() and lease.pid == os.getpid():
        return True, "held by this same process"
    elif lease.host == socket.gethostname():
        start = _start_time(lease.pid)
        if not start or (lease.pid_start and start != lease.pid_start):
            return True, f"pid {lease.pid} is no longer running on {lease.host}"
        return False, f"pid {lease.pid} is running"
    if age > STALE_AFTER_S:
        return True, f"its heartbeat is {age:.0f} s old (> {STALE_AFTER_S:.0f} s)"
    return False, f"its heartbeat is {age:.0f} s old"


def _squeue_state(job_id: str) -> str | None:
    """The job's state from squeue; "" when squeue no longer knows it; None when squeue cannot be
    asked (no Slurm here, or it did not answer): then the heartbeat decides."""
    from . import slurm
    from .errors import SlurmError

    try:
        out = slurm.run(["squeue", "-h", "-j", job_id, "-o", "%T"], timeout=20).stdout
    except SlurmError as exc:
        return "" if "Invalid job id" in str(exc) else None
    states = out.split()
    return states[0] if states else ""


def check_free(root: Path, owner: str | None = None, *, takeover: bool = False) -> Lease | None:
    """Raise RootOwnedError when `root` is owned by someone other than `owner` and may not be
    taken (alive; or gone without `takeover`). Returns the lease that may be taken over, if any.
    Reads only."""
    current = read_lease(root)
    if current is None or current.owner == owner:
        return None
    gone, why = judge(current)
    if not gone:
        raise RootOwnedError(f"checkpoint root {root} is owned by {current.describe()}: {why}; refusing to "
                             "start a second writer. Wait for it to end (or cancel it), then pass --takeover, "
                             "or choose another --ckpt-dir")
    if not takeover:
        raise RootOwnedError(f"checkpoint root {root} was owned by {current.describe()}, and {why}: pass "
                             "--takeover to take the root over")
    return current


def acquire(root: Path, owner: str, *, takeover: bool = False, pid: int | None = None) -> Lease:
    """Take or renew the lease for `owner` (the same owner renews, keeping `since`). Raises
    RootOwnedError per `check_free`; nothing else is written then."""
    with _lock(root):
        taken = check_free(root, owner, takeover=takeover)
        current = read_lease(root)
        lease = new_lease(owner, pid=pid)
        if current is not None and current.owner == owner:
            lease = replace(lease, since=current.since)
        _write(root, lease)
    if taken is not None:
        log.warning("took over %s from %s", root, taken.describe())
    return lease


def release(root: Path, owner: str) -> None:
    """Remove the lease if (and only if) it is still `owner`'s. Best effort."""
    try:
        with _lock(root):
            current = read_lease(root)
            if current is not None and current.owner == owner:
                os.unlink(lease_path(root))
    except Exception as exc:  # noqa: BLE001 - a lease left behind is judged gone later
        log.warning("could not release the lease on %s: %s", root, exc)


def refresh(root: Path, owner: str) -> bool:
    """Rewrite the heartbeat; False (and nothing written) when the lease no longer names `owner`."""
    with _lock(root):
        current = read_lease(root)
        if current is None or current.owner != owner:
            return False
        _write(root, replace(current, heartbeat=time.time()))
        return True


class Holder:
    """A lease held by this process, refreshed every HEARTBEAT_S by a daemon thread."""

    def __init__(self, root: Path, owner: str) -> None:
        self.root, self.owner = Path(root), owner
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="slurmresume-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not refresh(self.root, self.owner):
                    self.lost = True
                    log.error("the lease on %s no longer names %s: another run took this root over",
                              self.root, self.owner)
                    return
            except Exception as exc:  # noqa: BLE001 - retried at the next beat
                log.warning("lease heartbeat on %s failed: %s", self.root, exc)

    def stop(self) -> None:
        self._stop.set()

    def release(self) -> None:
        self.stop()
        release(self.root, self.owner)


def hold(root: Path, owner: str, *, takeover: bool = False) -> Holder:
    """Acquire (see `acquire`) and keep refreshing. The launcher's first node calls this."""
    acquire(root, owner, takeover=takeover)
    return Holder(root, owner)


@dataclass
class _Claim:
    """This process's lease on one root, shared by its open Checkpointers."""

    holder: Holder
    users: int  # open Checkpointers counting on it
    pid: int  # the process that took it (a forked child inherits the entry, not the lease)


_HELD: dict[tuple[str, str], _Claim] = {}  # (root, owner) -> claim
_HELD_LOCK = threading.Lock()


def for_checkpointer(root: Path) -> tuple[str, str] | None:
    """Rank 0 of a `Checkpointer`. Under the launcher ($SLURMRESUME_OWNER set): check that the
    lease names this run. Bare (no launcher): take the lease for this Slurm job, or this process,
    taking over an owner that is provably gone; one heartbeat per root and process, shared by the
    process's open Checkpointers. Returns the key to hand to `unclaim` when the Checkpointer
    closes (None: nothing taken). Raises RootOwnedError when another live run owns the root."""
    from .contract import ENV_OWNER

    mine = os.environ.get(ENV_OWNER)
    if mine:
        current = read_lease(root)
        if current is not None and current.owner != mine:
            raise RootOwnedError(f"checkpoint root {root} is owned by {current.describe()}, not by this run "
                                 f"({mine}): refusing to write into it")
        return None
    if not Path(root).is_dir():
        return None  # nothing to protect yet, and restoring must not create the root (the first save does)
    job = os.environ.get("SLURM_JOB_ID")
    owner = slurm_owner(job) if job else f"local-{socket.gethostname()}-{os.getpid()}"
    key = (str(Path(root).absolute()), owner)
    with _HELD_LOCK:
        held = _HELD.get(key)
        if held is not None and not held.holder.lost:
            held.users += 1
            return key
        try:
            acquire(root, owner, takeover=True)
        except OSError as exc:  # a read-only root can still be restored from; saves will say why they fail
            log.warning("cannot write the lease %s (%s): continuing without one", lease_path(root), exc)
            return None
        _HELD[key] = _Claim(Holder(root, owner), 1, os.getpid())
        return key


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

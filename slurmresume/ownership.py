"""One owner per checkpoint root: a lease file, `<root>/.owner.json`, that the run writing the
root holds and refreshes.

Why a lease and not a lock: `flock` is node-local on Lustre with `localflock` (and reportedly on
GPFS), and NFS may show a file late; a small JSON record, written atomically (temp, fsync,
rename, directory fsync) and refreshed by a heartbeat, is visible to every node. A filelock
(`.owner.json.lock`) guards the read-modify-write where it works; where it does not, the
heartbeat notices a lost lease (the file names someone else) and says so.

The record: owner id, kind ("slurm" | "local"), Slurm job id, pid, host, since (first taken),
heartbeat (last refreshed), the holder's heartbeat interval, the holder's identity (identity.py:
boot id, pid namespace, pid start time: a pid means something only in its own namespace and
boot), and for a Slurm owner the ClusterName. Who is the same owner: every run of one Slurm job
(requeues keep the job id: owner "slurm-<job id>") and every restart of one `submit --local`
(one launcher process; a bare `Checkpointer`: one process, its owner id drawn at random).
Ranks under the launcher do not acquire: they check that the lease names their launcher's run
($SLURMRESUME_OWNER); a `Checkpointer`'s side is `train/claims.py`.

When an owner is gone: `evidence.py` (the rules, a pure function). With strong proof (the job
terminal on the cluster the lease records; a local pid dead in its own boot and pid namespace)
the root is taken over without a flag, in one log line naming the previous owner; a fresh
heartbeat always wins (the taker waits it out when the proof is strong); a stale heartbeat alone
is weak evidence and needs --takeover (a bare `Checkpointer`: $SLURMRESUME_TAKEOVER=1). A live
owner is never taken over.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from . import evidence, identity
from .checkpoint.layout import OWNER, OWNER_LOCK
from .errors import ConfigError

log = logging.getLogger("slurmresume")

HEARTBEAT_S = 30.0
STALE_AFTER_S = evidence.STALE_AFTER_S
LOCK_WAIT_S = 10.0
MAX_LEASE_BYTES = 16 << 10


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
    cluster: str = ""  # a Slurm owner's ClusterName: only that cluster's answers about its job count
    boot_id: str = ""  # the host's boot: a pid on another boot (or a same-named host) says nothing
    heartbeat_s: float = HEARTBEAT_S  # the holder's refresh interval: fresh = under 3 of them
    pid_ns: int = 0  # the pid's namespace (0: unknown, an older record): another container's pid says nothing

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
    me = identity.this_process() if pid is None else identity.of_pid(pid)
    kind = "slurm" if owner.startswith("slurm-") else "local"
    now = time.time()
    cluster = (evidence.cluster_name() or "") if kind == "slurm" else ""
    return Lease(owner, kind, owner.removeprefix("slurm-") if kind == "slurm" else None, me.pid,
                 me.host, now, now, me.start, cluster, me.boot_id, heartbeat_interval(), me.pid_ns)


def heartbeat_interval() -> float:
    """The holder's refresh interval: HEARTBEAT_S, or $SLURMRESUME_LEASE_HEARTBEAT_S (tests)."""
    from .contract import ENV_LEASE_HEARTBEAT

    try:
        value = float(os.environ.get(ENV_LEASE_HEARTBEAT, "") or HEARTBEAT_S)
    except ValueError:
        return HEARTBEAT_S
    return min(max(value, 0.1), HEARTBEAT_S) if value == value else HEARTBEAT_S


def read_lease(root: Path) -> Lease | None:
    """The current lease, or None (no file, or unreadable: a torn or hostile file is ignored)."""
    try:
        fd = os.open(lease_path(root), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        raw: Any = json.loads(os.read(fd, MAX_LEASE_BYTES))
        who = identity.ProcessId.from_record(raw)  # fields an older version did not write: unknown
        return Lease(str(raw["owner"]), str(raw["kind"]), None if raw.get("job_id") is None else str(raw["job_id"]),
                     who.pid, str(raw["host"]), float(raw["since"]), float(raw["heartbeat"]), who.start,
                     str(raw.get("cluster") or ""), who.boot_id, float(raw.get("heartbeat_s") or HEARTBEAT_S),
                     who.pid_ns)
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


def judge(lease: Lease, now: float | None = None) -> evidence.Verdict:
    """The verdict on `lease` from what this process observes now (evidence.py)."""
    now = time.time() if now is None else now
    return evidence.weigh(lease, evidence.observe(lease, now))


def check_free(root: Path, owner: str | None = None, *, takeover: bool = False, wait: bool = True,
               hint: str = "pass --takeover") -> Lease | None:
    """Raise RootOwnedError when `root` is owned by someone other than `owner` and may not be
    taken: alive (a fresh heartbeat included), or only weakly gone (a stale heartbeat) without
    `takeover`. Returns the lease that may be taken over, if any. With strong proof that the
    owner is gone but a fresh heartbeat, `wait` waits the heartbeat out first (at most
    3 heartbeat intervals, logged). Reads only."""
    found = _check(root, owner, takeover=takeover, wait=wait, hint=hint)
    return found[0] if found else None


def _check(root: Path, owner: str | None, *, takeover: bool, wait: bool, hint: str) -> tuple[Lease, str] | None:
    current = read_lease(root)
    if current is None or current.owner == owner:
        return None
    verdict = judge(current)
    if verdict.state == evidence.FRESH and wait:
        current, verdict = _wait_out(root, current, verdict)
        if current is None or current.owner == owner:
            return None
    if verdict.state in (evidence.ALIVE, evidence.FRESH):
        raise RootOwnedError(f"checkpoint root {root} is owned by {current.describe()}: {verdict.why}; refusing to "
                             "start a second writer. Wait for it to end (or cancel it), or choose another --ckpt-dir")
    if verdict.state == evidence.STALE and not takeover:
        raise RootOwnedError(f"checkpoint root {root} was owned by {current.describe()}, and {verdict.why}, but "
                             f"that alone does not prove it gone: once sure it is, {hint} to take the root over")
    return current, verdict.why


def _wait_out(root: Path, lease: Lease, verdict: evidence.Verdict) -> tuple[Lease | None, evidence.Verdict]:
    """The owner is provably gone but its heartbeat is fresh: wait until it is not (re-reading
    the lease, which a live holder would refresh), at most FRESH_BEATS intervals and a margin."""
    log.warning("checkpoint root %s: %s; waiting %.0f s for its heartbeat to age", root, verdict.why,
                verdict.fresh_for)
    deadline = time.monotonic() + evidence.FRESH_BEATS * HEARTBEAT_S + 5.0
    current: Lease | None = lease
    while current is not None and verdict.state == evidence.FRESH and time.monotonic() < deadline:
        time.sleep(min(verdict.fresh_for + 0.2, max(deadline - time.monotonic(), 0.0)))
        current = read_lease(root)
        verdict = judge(current) if current is not None else verdict
    return current, verdict


def acquire(root: Path, owner: str, *, takeover: bool = False, pid: int | None = None,
            hint: str = "pass --takeover") -> Lease:
    """Take or renew the lease for `owner` (the same owner renews, keeping `since`). Raises
    RootOwnedError per `check_free`; nothing else is written then. A takeover is logged in one
    line naming the previous owner and the evidence."""
    check_free(root, owner, takeover=takeover, hint=hint)  # waits out a fresh heartbeat, outside the lock
    with _lock(root):
        taken = _check(root, owner, takeover=takeover, wait=False, hint=hint)
        current = read_lease(root)
        lease = new_lease(owner, pid=pid)
        if current is not None and current.owner == owner:
            lease = replace(lease, since=current.since)
        _write(root, lease)
    if taken is not None:
        log.warning("took over %s from %s: %s", root, taken[0].describe(), taken[1])
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
        self.root, self.owner, self.interval = Path(root), owner, heartbeat_interval()
        self.lost = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="slurmresume-lease", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if not refresh(self.root, self.owner):
                    self.lost = True
                    log.error("the lease on %s no longer names %s: another run took this root over",
                              self.root, self.owner)
                    return
            except Exception as exc:  # noqa: BLE001 - retried at the next beat
                log.warning("lease heartbeat on %s failed: %s", self.root, exc)

    def still_held(self) -> bool:
        """False once the lease names another owner (read now, not only at the next beat)."""
        current = read_lease(self.root)
        self.lost = self.lost or (current is not None and current.owner != self.owner)
        return not self.lost

    def stop(self) -> None:
        self._stop.set()

    def release(self) -> None:
        self.stop()
        release(self.root, self.owner)


def hold(root: Path, owner: str, *, takeover: bool = False) -> Holder:
    """Acquire (see `acquire`) and keep refreshing. The launcher's first node calls this."""
    acquire(root, owner, takeover=takeover)
    return Holder(root, owner)

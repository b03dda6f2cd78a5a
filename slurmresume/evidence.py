"""Is the owner named in a root's lease gone? The evidence rules (DESIGN §8), as a pure function
(`weigh`) over what this process observed (`observe`, the seam that asks /proc and Slurm).

A local owner's pid is judged only where it means something (identity.py): from the same boot
and the same pid namespace, with its start time. From another container, another boot, or from a
lease that predates these fields, the pid is unknown: never "this same process", never "dead";
only the heartbeat speaks.

The rules, in order:
  1. The lease is this very process's (boot, pid namespace, pid and start time all equal): it is
     ours (not a second writer).
  2. Proof of life: the Slurm job is pending/running per `scontrol`/`sacct` on the cluster the
     lease records; or a local owner's pid runs in this boot and pid namespace with its start time.
  3. A fresh heartbeat (younger than FRESH_BEATS of the holder's own heartbeat intervals) always
     wins: nothing else is believed while the holder may still be refreshing its lease.
  4. Strong proof of death ("proven"): the job is in a terminal state per `scontrol`/`sacct` on
     the lease's cluster (this machine's ClusterName must equal it: another cluster's answers
     about job N are about another job N); or, for a local owner of this boot and pid namespace,
     its pid is dead or now names a process with another start time. A takeover needs no flag.
  5. Weak evidence ("stale"): only the heartbeat is old (over STALE_AFTER_S), e.g. another host,
     another container, another cluster, Slurm not answering, or "Invalid job id" (MinJobAge
     purged it, or the id belongs to another cluster): a takeover needs the user's --takeover.
  6. Otherwise alive.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Protocol

from . import identity
from .identity import ProcessId

STALE_AFTER_S = 600.0
FRESH_BEATS = 3
TERMINAL = frozenset({"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE",
                      "OUT_OF_MEMORY", "PREEMPTED", "SPECIAL_EXIT", "REVOKED"})
ALIVE, FRESH, PROVEN, STALE = "alive", "fresh", "proven", "stale"


class Owner(Protocol):
    """What a lease says about its holder (ownership.Lease)."""

    @property
    def kind(self) -> str: ...

    @property
    def job_id(self) -> str | None: ...

    @property
    def pid(self) -> int: ...

    @property
    def host(self) -> str: ...

    @property
    def heartbeat(self) -> float: ...

    @property
    def pid_start(self) -> str: ...

    @property
    def cluster(self) -> str: ...

    @property
    def boot_id(self) -> str: ...

    @property
    def heartbeat_s(self) -> float: ...

    @property
    def pid_ns(self) -> int: ...


@dataclass(frozen=True)
class Facts:
    """What this process observed. `job_state`: the lease's job per scontrol/sacct here (None: no
    answer, or not asked because the clusters differ); `pid_start`: the lease pid's start time
    here ("" no such process; None: not asked (another boot or pid namespace) or not seen).
    `host`, `boot_id`, `pid_ns`, `pid`, `start`: this process (`me`; 0 and "" unknown)."""

    now: float
    host: str
    pid: int
    boot_id: str
    cluster: str | None
    job_state: str | None
    pid_start: str | None
    pid_ns: int = 0
    start: str = ""

    @property
    def me(self) -> ProcessId:
        return ProcessId(self.host, self.boot_id, self.pid_ns, self.pid, self.start)


@dataclass(frozen=True)
class Verdict:
    state: str  # ALIVE | FRESH (proven, but the heartbeat is fresh: wait) | PROVEN | STALE
    why: str
    fresh_for: float = 0.0  # seconds until the heartbeat stops being fresh


def holder(lease: Owner) -> ProcessId:
    """The process a lease names (its unknown parts: a lease written before they were recorded)."""
    return ProcessId(lease.host, lease.boot_id, lease.pid_ns, lease.pid, lease.pid_start)


def weigh(lease: Owner, facts: Facts) -> Verdict:
    """Pure: the verdict on `lease` given `facts` (rules in the module docstring)."""
    if lease.kind == "local" and identity.same_process(holder(lease), facts.me):
        return Verdict(PROVEN, "held by this same process")
    proof, unjudged = None, ""
    if lease.kind == "slurm" and lease.job_id:
        if lease.cluster and facts.cluster == lease.cluster and facts.job_state:
            if facts.job_state not in TERMINAL:
                return Verdict(ALIVE, f"job {lease.job_id} is {facts.job_state} on cluster {lease.cluster}")
            proof = f"job {lease.job_id} has ended ({facts.job_state} on cluster {lease.cluster})"
    else:
        seen = identity.judge(holder(lease), facts.me, facts.pid_start)
        if seen == identity.RUNS:
            return Verdict(ALIVE, f"pid {lease.pid} is running on {lease.host}")
        if seen == identity.GONE:
            proof = f"pid {lease.pid} is no longer running on {lease.host}"
        elif lease.kind == "local":
            unjudged = identity.why_unknown(holder(lease), facts.me)
    age = facts.now - lease.heartbeat
    window = FRESH_BEATS * max(lease.heartbeat_s, 0.1)
    if age < window:
        why = f"its heartbeat is {max(age, 0):.0f} s old (fresh: under {window:.0f} s)"
        return Verdict(FRESH, f"{proof}, but {why}", window - age) if proof else Verdict(ALIVE, why)
    if proof:
        return Verdict(PROVEN, proof)
    if age > STALE_AFTER_S:
        return Verdict(STALE, f"its heartbeat is {age:.0f} s old (> {STALE_AFTER_S:.0f} s){unjudged}")
    return Verdict(ALIVE, f"its heartbeat is {age:.0f} s old{unjudged}")


# -- the seam: what this process can observe ---------------------------------------------------


def observe(lease: Owner, now: float) -> Facts:
    me = identity.this_process()
    cluster = cluster_name() if lease.kind == "slurm" else None
    job_state = job_state_here(lease.job_id) if (lease.kind == "slurm" and lease.job_id and lease.cluster
                                                  and cluster == lease.cluster) else None
    asks = lease.kind == "local" and identity.comparable(holder(lease), me)
    pid_start = identity.look(lease.pid) if asks else None
    return Facts(now, me.host, me.pid, me.boot_id, cluster, job_state, pid_start, me.pid_ns, me.start)


@functools.lru_cache(maxsize=1)
def cluster_name() -> str | None:
    """This machine's Slurm ClusterName ($SLURM_CLUSTER_NAME in a job, else `scontrol show
    config`); None without Slurm or an answer."""
    from . import slurm
    from .errors import SlurmError

    name = os.environ.get("SLURM_CLUSTER_NAME", "").strip()
    if name:
        return name
    try:
        out = slurm.run(["scontrol", "show", "config"], timeout=20).stdout
    except SlurmError:
        return None
    m = re.search(r"^ClusterName\s*=\s*(\S+)", out, re.MULTILINE)
    return m.group(1) if m else None


def job_state_here(job_id: str) -> str | None:
    """The job's state per `scontrol show job` (slurmctld), else `sacct` (the accounting
    database, which remembers jobs slurmctld purged); None when neither knows it or answers.
    "Invalid job id" is not an answer: the id may be purged, or another cluster's."""
    from . import slurm
    from .errors import SlurmError

    try:
        out = slurm.run(["scontrol", "show", "job", "-o", job_id], timeout=20).stdout
        m = re.search(r"\bJobState=(\S+)", out)
        if m:
            return m.group(1)
    except SlurmError:
        pass
    try:
        out = slurm.run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State"], timeout=20).stdout
    except SlurmError:
        return None
    states = [line.split()[0] for line in out.splitlines() if line.strip()]
    if not states:
        return None
    alive = [s for s in states if s not in TERMINAL]
    return alive[0] if alive else states[-1]

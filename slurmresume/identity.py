"""Who a process is, in a form another process can judge later: the host, the kernel's boot,
the pid namespace, the pid, and that pid's start time. Leases (ownership.py), their evidence rules
(evidence.py) and the writer notes of unfinished directories (checkpoint/leftovers.py) record
one and judge it with `judge`.

Why each part: a pid alone names a process only in one pid namespace of one boot of one kernel.
Two containers on one host (same host name, same boot id) have their own pid namespaces and
hand out the same small pids; the init namespace has the same inode on every host; after a
reboot, or once pids wrap, the pid names another process (its start time then differs).
So a recorded pid is judged only from the same boot and the same pid namespace (and host name:
a VM cloned from a snapshot keeps its boot id); anywhere else it is unknown: weak evidence,
never "the same process", never "dead".

`judge` is pure; `this_process`, `of_pid` and `look` are the seam that reads /proc.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass, replace
from typing import Any

RUNS, GONE, UNKNOWN = "runs", "gone", "unknown"


@dataclass(frozen=True)
class ProcessId:
    """A process as recorded: "" and 0 mean unknown (a record written before these fields
    existed, or a machine whose /proc cannot say)."""

    host: str  # socket.gethostname()
    boot_id: str  # /proc/sys/kernel/random/boot_id: this boot of this kernel (host)
    pid_ns: int  # inode of the pid namespace the pid belongs to (/proc/self/ns/pid)
    pid: int
    start: str  # /proc/<pid>/stat field 22: clock ticks since boot

    def record(self) -> dict[str, Any]:
        """The fields a JSON record carries (the lease's and the writer note's names)."""
        return {"pid": self.pid, "host": self.host, "boot_id": self.boot_id, "pid_ns": self.pid_ns, "pid_start": self.start}

    @classmethod
    def from_record(cls, raw: Any) -> ProcessId:
        """From `record()`'s fields; a missing field is unknown. Raises KeyError, TypeError or
        ValueError on a record with no pid or a malformed field."""
        if not isinstance(raw, dict):
            raise TypeError(f"a record is a JSON object, not {type(raw).__name__}")
        pid_ns = raw.get("pid_ns") or 0
        if isinstance(pid_ns, bool) or not isinstance(pid_ns, int):
            raise ValueError(f"pid_ns {pid_ns!r} is not an inode number")
        return cls(str(raw.get("host") or ""), str(raw.get("boot_id") or ""), pid_ns, int(raw["pid"]), str(raw.get("pid_start") or ""))


def comparable(recorded: ProcessId, here: ProcessId) -> bool:
    """Pure: whether `recorded`'s pid can be looked up from `here` (both know their host, boot and
    pid namespace, and they are the same): only then does a pid seen here say anything about it."""
    return (bool(recorded.host) and recorded.host == here.host and bool(recorded.boot_id) and recorded.boot_id == here.boot_id
            and recorded.pid_ns != 0 and recorded.pid_ns == here.pid_ns)


def why_unknown(recorded: ProcessId, here: ProcessId) -> str:
    """Pure: why `recorded`'s pid says nothing from `here`, as a clause for a message ("" when it
    can be judged, or when looking it up could not tell)."""
    if comparable(recorded, here):
        return ""
    where = ("is another host's" if recorded.host and recorded.host != here.host else
             "is of another boot" if recorded.boot_id and here.boot_id and recorded.boot_id != here.boot_id else
             "is another pid namespace's (another container)" if recorded.pid_ns and here.pid_ns else
             "was recorded without its pid namespace (an older version)" if not recorded.pid_ns else
             "cannot be looked up here")
    return f"; its pid {recorded.pid} {where}: no proof either way"


def same_process(a: ProcessId, b: ProcessId) -> bool:
    """Pure: proof that `a` and `b` are one process (every part known and equal)."""
    return comparable(a, b) and a.pid == b.pid and bool(a.start) and a.start == b.start


def judge(recorded: ProcessId, here: ProcessId, start_now: str | None) -> str:
    """Pure: RUNS, GONE (proof: no process has the pid, or one that started at another time) or
    UNKNOWN (another boot or pid namespace, or an unknown part). `here`: the judging process;
    `start_now`: `look(recorded.pid)` there ("" no such process, None cannot tell or not asked)."""
    if not comparable(recorded, here) or start_now is None:
        return UNKNOWN
    if not start_now:
        return GONE
    if recorded.start and start_now != recorded.start:
        return GONE  # the pid was reused
    return RUNS


# -- the seam: /proc -----------------------------------------------------------------------------


def this_process() -> ProcessId:
    """The calling process (read through /proc/self, which names it even where /proc was
    mounted for another pid namespace)."""
    return ProcessId(socket.gethostname(), boot_id(), pid_namespace(), os.getpid(), _start_of("self"))


def of_pid(pid: int) -> ProcessId:
    """Process `pid` of this process's pid namespace (its start time "" when it cannot be seen)."""
    here = this_process()
    return here if pid == here.pid else replace(here, pid=pid, start=look(pid) or "")


def look(pid: int) -> str | None:
    """The start time of `pid` in this process's pid namespace: "" when no process has it, None
    when this process cannot tell (its /proc shows another pid namespace, /proc hides the process
    (`hidepid`), or there is no /proc)."""
    if pid <= 0 or not _proc_is_ours():
        return None
    start = _start_of(str(pid))
    if start:
        return start
    try:
        os.kill(pid, 0)  # the pid space of this namespace, /proc or not
    except ProcessLookupError:
        return ""
    except OSError:
        return None  # EPERM: it exists, another user's
    return None  # it exists, and /proc does not show it


def start_ticks(pid: int | str = "self") -> int | None:
    """Field 22 of /proc/<pid>/stat (the process's start, clock ticks since boot); None when there
    is no such process or /proc cannot be read. The command name (field 2) may hold spaces and
    parentheses: the fields are split after the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _start_of(pid: str) -> str:
    ticks = start_ticks(pid)
    return "" if ticks is None else str(ticks)


def _proc_is_ours() -> bool:
    """Whether /proc shows this process's pid namespace (`unshare --pid --fork` without
    --mount-proc keeps the parent's /proc: pid 1 there is someone else)."""
    try:
        return int(os.readlink("/proc/self")) == os.getpid()
    except (OSError, ValueError):
        return False


def pid_namespace() -> int:
    """The inode of this process's pid namespace; 0 when /proc cannot say."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


@functools.lru_cache(maxsize=1)
def boot_id() -> str:
    """This boot of this kernel ("" when /proc cannot say): one per host and boot, shared by the
    host's containers."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read(64).strip()
    except OSError:
        return ""

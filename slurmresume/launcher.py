"""The per-node launcher: runs torchrun, keeps it alive on the warning signal, makes sure every
worker hears the signal, and decides what happens when torchrun exits (requeue, retry, stop).

Why forward at all: under proctrack/cgroup Slurm signals only the srun task (this process),
never torchrun's agent or the workers; and an unhandled SIGUSR1 would kill the agent. So torchrun
starts with the warning signal ignored (inherited across exec; each worker installs its own
handler), and this process relays the signal to the worker processes itself.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint.layout import MARKER, step_dir_name
from .checkpoint.store import find_latest
from .config import requeue_cap_reached
from .events import append_event, read_events
from .signals import parse_signal

log = logging.getLogger("slurmresume")

RELAY_EVERY = 1.0  # seconds between re-sends while workers have not acted (start-up race)


@dataclass(frozen=True)
class RunResult:
    """How one torchrun run ended, as seen from this node."""

    kind: str  # "finished" | "preempted" | "terminated" | "failed"
    returncode: int
    saved_step: int | None  # the step saved after the signal, when kind is preempted/terminated
    latest_before: int | None
    latest_after: int | None

    @property
    def progressed(self) -> bool:
        return self.latest_after is not None and (self.latest_before is None or self.latest_after > self.latest_before)


def decide(result: RunResult, *, first_node: bool, requeues_done: int, max_requeues: int | None,
           failures_done: int, max_failures: int, previous_progressed: bool | None,
           committed: bool) -> tuple[str, str]:
    """Pure: what to do after a run. Returns (action, reason); action is one of
    "finish", "requeue", "retry", "stop" (a clean exit without requeue), "give_up" (fail the job)."""
    if result.kind == "finished":
        return "finish", "training finished"
    if result.kind == "terminated":
        return "stop", f"terminated (SIGTERM); saved step {result.saved_step}; not requeueing"
    if result.kind == "preempted":
        if not first_node:
            return "stop", "preempted: the first node requeues the job"
        if not committed:
            return "give_up", f"warning signal handled but step {result.saved_step} has no commit marker"
        if requeue_cap_reached(requeues_done, max_requeues):  # None: no cap (config.py)
            return "give_up", f"preempted after {requeues_done} requeues: --max-requeues {max_requeues} reached"
        if not result.progressed and previous_progressed is False:
            return "give_up", ("crash loop: no new committed step in two consecutive runs "
                               f"(newest is still {result.latest_after})")
        return "requeue", f"preempted at step {result.saved_step}, committed"
    if failures_done < max_failures:
        return "retry", (f"workers failed (exit {result.returncode}); retry {failures_done + 1} of "
                         f"{max_failures} from the newest complete checkpoint")
    return "give_up", f"workers failed (exit {result.returncode}) and --max-failures {max_failures} is used up"


def worker_pids(agent_pid: int) -> list[int]:
    """The agent's direct children: the rank processes (DataLoader workers are their children)."""
    pids: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{agent_pid}/task"):
            with open(f"/proc/{agent_pid}/task/{tid}/children") as f:
                pids.extend(int(p) for p in f.read().split())
    except OSError:
        pass
    return pids


class Relay:
    """Flag-only handlers in the launcher; `pump()` (normal code) forwards what arrived."""

    def __init__(self, warn: signal.Signals) -> None:
        self.warn = warn
        self.pending: set[int] = set()
        self.seen: list[int] = []
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: object) -> None:
        self.pending.add(signum)
        self.seen.append(signum)

    def install(self) -> None:
        for s in {self.warn, signal.SIGTERM}:
            self._previous[s] = signal.signal(s, self._handler)

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()

    def strongest(self) -> int | None:
        if self.warn in self.pending:
            return self.warn
        return signal.SIGTERM if signal.SIGTERM in self.pending else None


def _ignore_warning(sig: int) -> Any:
    def preexec() -> None:
        signal.signal(sig, signal.SIG_IGN)

    return preexec


def run_torchrun(cmd: list[str], env: dict[str, str], root: Path, run_id: str, warn: signal.Signals,
                 relay: Relay, log_file: Any = None) -> RunResult:
    """Start torchrun, relay signals to its workers until it exits, classify the outcome."""
    latest_before = _latest_step(root)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=_ignore_warning(warn), stdout=log_file, stderr=log_file)
    last_sent = 0.0
    sent: int | None = None
    while True:
        try:
            rc = proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        sig = relay.strongest()
        if sig is not None and (sig != sent or time.monotonic() - last_sent > RELAY_EVERY):
            pids = worker_pids(proc.pid)
            for pid in pids:
                _kill(pid, sig)
            if pids:
                if sig != sent:
                    append_event(root, "signal_forwarded", signal=signal.Signals(sig).name, workers=len(pids),
                                 run_id=run_id)
                sent, last_sent = sig, time.monotonic()
    exit_event = _exit_event(root, run_id)
    latest_after = _latest_step(root)
    if exit_event is not None:
        kind = "preempted" if exit_event.get("kind") == "preempt" else "terminated"
        return RunResult(kind, rc, exit_event.get("step"), latest_before, latest_after)
    if rc != 0 and relay.strongest() is not None and latest_after is not None and latest_after != latest_before:
        # The workers saved after the signal but could not log it (event log on a full disk), so
        # they exited non-zero (a clean exit would read as "finished"): the new marker is the proof.
        kind = "preempted" if relay.strongest() == warn else "terminated"
        return RunResult(kind, rc, latest_after, latest_before, latest_after)
    if relay.strongest() == signal.SIGTERM:
        return RunResult("terminated", rc, None, latest_before, latest_after)
    return RunResult("finished" if rc == 0 else "failed", rc, None, latest_before, latest_after)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _latest_step(root: Path) -> int | None:
    info = find_latest(root, warn=False)
    return info.step if info else None


def _exit_event(root: Path, run_id: str) -> dict | None:
    for ev in reversed(read_events(root)):
        if ev.get("run_id") == run_id and ev["event"] == "exit_after_save":
            return ev
    return None


def is_committed(root: Path, step: int | None) -> bool:
    return step is not None and (root / step_dir_name(step) / MARKER).exists()


def previous_progressed(root: Path, job_key: str) -> bool | None:
    """Whether the previous run of this job (same job id, or same local session) progressed."""
    for ev in reversed(read_events(root)):
        if ev["event"] == "run_ended" and ev.get("job_key") == job_key:
            return bool(ev.get("progressed"))
    return None


def run_id_for(job_key: str, restart: int, attempt: int) -> str:
    """The same on every node of a run (the rank that writes the exit event may live on any
    node), different for each restart and each retry after a failure."""
    return f"{job_key}.{restart}.{attempt}"


def warn_signal(name: str) -> signal.Signals:
    return parse_signal(name.removeprefix("B:"))

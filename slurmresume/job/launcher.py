"""The per-node launcher: runs torchrun, keeps it alive on the warning signal, makes sure every
worker hears the signal, and decides what happens when torchrun exits (requeue, retry, stop).

Why forward at all: under proctrack/cgroup Slurm signals only the srun task (this process),
never torchrun's agent or the workers; and an unhandled SIGUSR1 would kill the agent. So torchrun
starts with the warning signal ignored (inherited across exec; each worker installs its own
handler), and this process relays the signal to the worker processes itself.

torchrun runs in its own session (a Ctrl-C in the terminal reaches only this launcher, which turns
it into a best-effort save), and a guardian process kills the whole tree if this launcher dies.

What a run did is read from the contract (`contract.read_outcome`, written by rank 0), the exit
code and the commit markers on disk; never from the event log.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hangwatch import HangWatch

from .. import slurm
from ..checkpoint.store import newest_committed
from ..contract import (
    ENV_DUMP_SIGNAL,
    ENV_NONCE,
    EV_HANG,
    EV_INTERRUPTED,
    EV_RESUMED,
    Outcome,
    read_hang,
    read_mirror_behind,
    read_outcome,
    write_hang,
)
from ..events import try_append_event
from ..train.signals import parse_signal
from .guardian import Guardian, kill_tree, start_time
from .hang import Hang

log = logging.getLogger("slurmresume")

POLL_S = 0.1  # the relay loop's period: hang watch, heartbeat summary, re-sends
KILL_REAP_S = 30.0  # the longest the launcher waits for torchrun to exit after a hang kill
RELAY_EVERY = 1.0  # seconds between re-sends while workers have not acted (start-up race)
TERM_QUERY_TIMEOUT_S = 2.0  # asking slurmctld, at a SIGTERM, whether it is the time limit
START_QUERY_TIMEOUT_S = 5.0  # the job's EndTime and KillWait, read once at start
REQUEUE_BUDGET_S = 120.0  # the longest a requeue is retried when no SIGTERM bounds it


@dataclass(frozen=True)
class RunResult:
    """How one torchrun run ended, as seen from this node: facts only; `kind` names them."""

    returncode: int
    outcome: Outcome | None  # rank 0's record of what it did about a signal (None: no record)
    latest_before: int | None  # the newest committed step (by its marker) before the run
    latest_after: int | None  # ... and after it
    warned: bool = False  # the warning signal was relayed to this run
    stop: str | None = None  # "cancel" | "time_limit" | "interrupt": a SIGTERM/SIGINT, classified
    hang: Hang | None = None  # the hang watch found ranks stuck; the launcher dumped and killed the run
    ended_at: float | None = None  # time.time() of the first death seen, the hang kill, or torchrun's exit
    # rank 0's record that close() left the last committed step off the mirror (exit 78): (step, why)
    mirror_behind: tuple[int | None, str] | None = None

    @property
    def progressed(self) -> bool:
        return self.latest_after is not None and (self.latest_before is None or self.latest_after > self.latest_before)

    @property
    def kind(self) -> str:
        """finished | failed | hung | preempted | terminated | save_failed | warned_without_save |
        time_limit | cancelled | interrupted | mirror_behind (finished locally, the bucket lacks the
        last step)."""
        if self.hang is not None:
            return "hung"
        if self.stop is not None:
            return {"interrupt": "interrupted", "cancel": "cancelled", "time_limit": "time_limit"}[self.stop]
        if self.outcome is not None:
            if not self.outcome.committed:
                return "save_failed"
            return "preempted" if self.outcome.kind == "preempt" else "terminated"
        if self.warned and self.returncode != 0:
            return "save_failed"  # a crash (or a lost record) during the emergency save
        if self.warned and not self.progressed:
            return "warned_without_save"
        if self.returncode != 0 and self.mirror_behind is not None and self.latest_after is not None:
            return "mirror_behind"
        return "finished" if self.returncode == 0 else "failed"

    @property
    def saved_step(self) -> int | None:
        """The step this run's emergency save committed (None: none did)."""
        return self.outcome.step if self.outcome is not None and self.outcome.committed else None

    @property
    def lost_steps(self) -> int | None:
        """Steps the ranks had agreed to save that no complete checkpoint holds (a failed save)."""
        if self.outcome is None or self.outcome.committed:
            return None
        return max(0, self.outcome.step - (self.latest_after or 0))


def decide(result: RunResult, *, first_node: bool, requeues_done: int, max_requeues: int | None,
           failures_done: int, max_failures: int, previous_progressed: bool | None, hangs_done: int = 0,
           max_hangs: int = 0, previous_hang: tuple[tuple[int, ...], int] | None = None) -> tuple[str, str]:
    """Pure: what to do after a run. Returns (action, reason); action is one of
    "finish", "requeue", "retry" (restart inside the allocation), "stop" (a clean exit without
    requeue), "give_up" (fail the job), "hold" (the same hang twice: keep the job, held),
    "behind" (training finished and is committed locally, the mirror lacks the last step: end
    with EXIT_MIRROR_BEHIND, no retry: re-running would train nothing; the next run uploads it).

    One rule for every way a run can end elsewhere than at its last step without a user asking it
    to stop (a committed preemption, a failed emergency save, the time limit): requeue and resume
    from the newest complete checkpoint, if there is one. A user's stop (scancel, SIGTERM, Ctrl-C)
    is never undone by a requeue."""
    kind = result.kind
    if kind == "hung":
        return _decide_hang(result, hangs_done, max_hangs, previous_hang)
    if kind == "finished":
        if result.latest_after is None:
            return "finish", "training finished, but no checkpoint was ever committed (no ckpt.step()/save() call?)"
        return "finish", "training finished"
    if kind == "mirror_behind":
        assert result.mirror_behind is not None
        step, why = result.mirror_behind
        what = f"step {step}" if step is not None else "the newest step"
        return "behind", (f"training finished at step {result.latest_after}, committed locally, but {what} is not "
                          f"on the mirror ({why}); not retrying: the next run with this mirror uploads it")
    if kind in ("cancelled", "terminated", "interrupted"):
        what = {"cancelled": "cancelled (SIGTERM, not the time limit)", "terminated": "terminated (SIGTERM)",
                "interrupted": "interrupted (SIGINT)"}[kind]
        saved = f"saved step {result.saved_step}" if result.saved_step is not None else "no new save"
        return "stop", f"{what}; {saved}; not requeueing"
    if kind == "warned_without_save":
        return "give_up", ("the warning signal reached the script but it saved nothing (no ckpt.step() "
                           "after it?): this run's work since the last checkpoint is lost")
    if kind == "failed":
        if failures_done < max_failures:
            return "retry", (f"workers failed (exit {result.returncode}); retry {failures_done + 1} of "
                             f"{max_failures} from the newest complete checkpoint")
        if max_failures == 0:  # no retry was asked for: say what to do, not that a budget of 0 ran out
            return "give_up", (f"workers failed (exit {result.returncode}): the script's error is above; fix it and "
                               "run the same command (it resumes from the newest checkpoint)")
        return "give_up", f"workers failed (exit {result.returncode}) and --max-failures {max_failures} is used up"
    why = _why(result)
    if not first_node:
        return "stop", f"{why}: the first node requeues the job"
    if result.latest_after is None:
        return "give_up", f"{why}, and there is no complete checkpoint to resume from"
    if max_requeues is not None and requeues_done >= max_requeues:
        return "give_up", f"{why}; after {requeues_done} requeues: --max-requeues {max_requeues} reached"
    if not result.progressed and previous_progressed is False:
        return "give_up", ("crash loop: no new committed step in two consecutive runs "
                           f"(newest is still {result.latest_after})")
    return "requeue", why


def _decide_hang(result: RunResult, hangs_done: int, max_hangs: int,
                 previous_hang: tuple[tuple[int, ...], int] | None) -> tuple[str, str]:
    hang = result.hang
    assert hang is not None
    what = (f"rank(s) {', '.join(map(str, hang.ranks))} hung in {hang.phase} after step {hang.step} "
            f"(silent {hang.silent_s:.0f} s, budget {hang.budget_s:.0f} s)")
    if previous_hang == hang.key and not result.progressed:
        return "hold", (f"{what}, the same hang as the previous run and no new checkpoint since: restarting "
                        "again would hang again; see the stack dumps (slurmresume status), fix, then release the job")
    if hangs_done < max_hangs:
        source = ("the start (no complete checkpoint yet)" if result.latest_after is None else
                  f"the newest complete checkpoint (step {result.latest_after})")
        return "retry", f"{what}; restart {hangs_done + 1} of {max_hangs} (--max-hangs) in this allocation from {source}"
    return "give_up", f"{what}, and --max-hangs {max_hangs} is used up"


def _why(result: RunResult) -> str:
    if result.kind == "preempted":
        return f"preempted at step {result.saved_step}, committed"
    if result.kind == "time_limit":
        return (f"time limit reached before a new commit; resuming from the newest complete checkpoint "
                f"(step {result.latest_after})")
    err = f" ({result.outcome.error})" if result.outcome is not None and result.outcome.error else ""
    agreed = f" of step {result.outcome.step}" if result.outcome is not None else ""
    lost = f", {result.lost_steps} step(s) lost" if result.lost_steps is not None else ""
    return f"the emergency save{agreed} failed{err}; resuming from step {result.latest_after}{lost}"


class JobClock:
    """Slurm's facts about this job, read once at start (EndTime, KillWait), and the rule that
    tells the time limit's SIGTERM from a cancel (`slurm.is_time_limit`).

    `read` asks slurmctld in a background thread: torchrun starts without waiting for the
    answers (a controller busy with a wave of preemptions answers slowly, exactly when a
    requeued job starts); the first use of `end_time` or `kill_wait` waits for them (each query
    bounded by START_QUERY_TIMEOUT_S, then Slurm's defaults)."""

    def __init__(self, job_id: str, end_time: float | None = None,
                 kill_wait: float = slurm.DEFAULT_KILL_WAIT_S) -> None:
        self.job_id = job_id
        self._end_time = end_time
        self._kill_wait = kill_wait
        self._reader: threading.Thread | None = None

    @classmethod
    def read(cls, job_id: str) -> JobClock:
        clock = cls(job_id)
        clock._reader = threading.Thread(target=clock._read, name="slurmresume-job-clock", daemon=True)
        clock._reader.start()
        return clock

    def _read(self) -> None:
        times = slurm.job_times(self.job_id, START_QUERY_TIMEOUT_S)
        self._end_time = times.end_time if times else None
        self._kill_wait = slurm.kill_wait(START_QUERY_TIMEOUT_S)

    def _wait(self) -> None:
        if self._reader is not None:
            self._reader.join()

    @property
    def end_time(self) -> float | None:
        self._wait()
        return self._end_time

    @property
    def kill_wait(self) -> float:
        self._wait()
        return self._kill_wait

    def classify_term(self, at: float) -> str:
        now = slurm.job_times(self.job_id, TERM_QUERY_TIMEOUT_S)
        return "time_limit" if slurm.is_time_limit(now, self.end_time, at) else "cancel"

    def requeue_deadline(self, relay: Relay, began: float) -> float:
        """A time.time() by which the requeue must have worked: KillWait after a SIGTERM (Slurm
        SIGKILLs us then; evaluated again before each attempt), else REQUEUE_BUDGET_S from `began`."""
        if relay.term_at is not None:
            return min(relay.term_at + self.kill_wait - 0.5, began + REQUEUE_BUDGET_S)
        return began + REQUEUE_BUDGET_S


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
    """Flag-only handlers in the launcher (the warning, SIGTERM, SIGINT); `pump()`-style normal
    code in `run_torchrun` forwards what arrived. Installed first thing, before any Slurm call.
    Each handler also writes a byte to a pipe that `wait()` watches, so the relay loop forwards
    a signal when it comes, not at its next turn."""

    def __init__(self, warn: signal.Signals) -> None:
        self.warn = warn
        self.pending: set[int] = set()
        self.seen: list[int] = []
        self.term_at: float | None = None  # time.time() of the first SIGTERM
        self.interrupts = 0
        self._previous: dict[int, Any] = {}
        self._wake: tuple[int, int] | None = None  # (read, write) ends of the wake-up pipe

    def _handler(self, signum: int, frame: object) -> None:
        self.pending.add(signum)
        self.seen.append(signum)
        if signum == signal.SIGTERM and self.term_at is None:
            self.term_at = time.time()
        if signum == signal.SIGINT:
            self.interrupts += 1
        if self._wake is not None:
            try:
                os.write(self._wake[1], b"\0")
            except OSError:  # full (a wake-up is pending anyway) or closed
                pass

    def install(self) -> None:
        if self._wake is None:
            self._wake = os.pipe()
            for fd in self._wake:
                os.set_blocking(fd, False)
        for s in {self.warn, signal.SIGTERM, signal.SIGINT}:
            self._previous[s] = signal.signal(s, self._handler)

    def uninstall(self) -> None:
        for s, prev in self._previous.items():
            signal.signal(s, prev)
        self._previous.clear()
        if self._wake is not None:
            for fd in self._wake:
                os.close(fd)
            self._wake = None

    def wait(self, timeout: float, pid_fd: int | None = None) -> bool:
        """Sleep up to `timeout`; back early when one of our signals arrives or the process behind
        `pid_fd` (a pidfd) exits. True when `pid_fd` is readable (the process has exited)."""
        fds = [fd for fd in (self._wake[0] if self._wake else None, pid_fd) if fd is not None]
        if not fds:
            time.sleep(timeout)
            return False
        poller = select.poll()  # not select(): no limit on the descriptors' numbers
        for fd in fds:
            poller.register(fd, select.POLLIN)
        ready = [fd for fd, _ in poller.poll(timeout * 1000)]
        if self._wake is not None and self._wake[0] in ready:
            try:
                while os.read(self._wake[0], 512):
                    pass
            except OSError:  # drained
                pass
        return pid_fd is not None and pid_fd in ready

    def strongest(self) -> int | None:
        """What the workers are told: the warning, else SIGTERM (for a SIGTERM or a SIGINT)."""
        if self.warn in self.pending:
            return self.warn
        return signal.SIGTERM if self.pending & {signal.SIGTERM, signal.SIGINT} else None


def _pidfd(pid: int) -> int | None:
    """A pidfd for `pid` (readable once it exits; Linux 5.3+), else None: exits are then seen at
    the relay loop's next turn."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _child_setup(sig: int) -> Any:
    def preexec() -> None:
        signal.signal(sig, signal.SIG_IGN)  # the agent must survive the warning (see module doc)
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    return preexec


def run_torchrun(cmd: list[str], env: dict[str, str], root: Path, run_id: str, warn: signal.Signals,
                 relay: Relay, log_file: Any = None, *, clock: JobClock | None = None,
                 guardian: Guardian | None = None, watch: HangWatch | None = None,
                 dumps: Path | None = None, lost: Callable[[], bool] | None = None) -> RunResult:
    """Start torchrun (own session, tracked by the guardian), relay signals to its workers until
    it exits, classify the outcome. A SIGTERM is a cancel, or with a `clock` (Slurm) possibly the
    time limit: then the run is not waited for beyond half of KillWait (no new commit can land
    in time; the requeue that follows kills it). With a `watch`: a rank silent beyond its phase's
    budget makes every rank dump its stacks (under `dumps`), a `hang` event, and the whole tree
    killed; the result then carries the hang. `lost()` true (the root's lease now names another
    run): the tree is killed at once, since nothing it saves may commit there any more."""
    latest_before = _latest_step(root)
    setup = guardian.preexec(_child_setup(warn)) if guardian is not None else _child_setup(warn)  # guardian.py
    proc = subprocess.Popen(cmd, env=env, preexec_fn=setup, stdout=log_file, stderr=log_file, start_new_session=True)
    tree = {proc.pid: start_time(proc.pid) or 0}
    if guardian is not None:
        guardian.track(proc.pid)
    last_sent = 0.0
    sent: int | None = None
    stop: str | None = None
    give_up_at: float | None = None
    rc: int | None = None
    hang: Hang | None = None
    ended_at: float | None = None
    pid_fd = _pidfd(proc.pid)
    try:
        while True:
            exited = relay.wait(POLL_S, pid_fd)
            rc = proc.poll()
            if rc is not None:
                ended_at = time.time()
                break
            if exited and pid_fd is not None:  # readable, yet not reapable: never spin on it
                os.close(pid_fd)
                pid_fd = None
            if watch is not None and relay.strongest() is None:
                hang = watch.poll(time.monotonic(), worker_pids(proc.pid))
                watch.publish(root, _summary_key(run_id, env), time.monotonic())
                if watch.resumed is not None and not watch.resumed_logged:
                    watch.resumed_logged = True  # the first step after a death/kill: the recovery time
                    try_append_event(root, EV_RESUMED, run_id=run_id, **watch.resumed)
                    log.info("resumed %.2f s after the %s", watch.resumed["seconds"], watch.resumed["cause"])
                if hang is not None:
                    ended_at = _handle_hang(hang, watch, proc.pid, tree, root, run_id, dumps or root / "logs" / run_id,
                                            env)
                    rc = _reap(proc, run_id)
                    break
            sig = relay.strongest()
            if sig is not None and (sig != sent or time.monotonic() - last_sent > RELAY_EVERY):
                pids = worker_pids(proc.pid)
                for pid in pids:
                    _kill(pid, sig)
                if pids:
                    if sig != sent:
                        try_append_event(root, "signal_forwarded", signal=signal.Signals(sig).name, workers=len(pids),
                                     run_id=run_id)
                    sent, last_sent = sig, time.monotonic()
            if stop is None:
                stop = _classify_stop(relay, clock, root, run_id)
                if stop == "time_limit" and clock is not None and relay.term_at is not None:
                    give_up_at = relay.term_at + clock.kill_wait / 2
            if relay.interrupts >= 2 or (lost is not None and lost()):  # a second Ctrl-C, a lost root: stop now
                kill_tree(tree)
            if give_up_at is not None and time.time() > give_up_at:
                rc = proc.poll()
                break
    finally:
        if pid_fd is not None:
            os.close(pid_fd)
    if watch is not None:
        if watch.death_at is not None and hang is None:
            ended_at = min(watch.death_at, ended_at or watch.death_at)
        watch.refresh()  # the ranks' last word, for `status`
        watch.publish(root, _summary_key(run_id, env), time.monotonic(), force=True)
        if hang is None and rc not in (None, 0):
            hang = _peer_hang(root, run_id, env.get(ENV_NONCE, ""))  # our ranks failed because another node killed its hung ones
    behind = read_mirror_behind(root, run_id, env.get(ENV_NONCE, "")) if rc not in (None, 0) else None
    return RunResult(rc if rc is not None else -1, read_outcome(root, run_id, env.get(ENV_NONCE, "")), latest_before, _latest_step(root),
                     warned=warn in relay.pending, stop=stop, hang=hang, ended_at=ended_at,
                     mirror_behind=(behind.get("step"), str(behind.get("error") or "?")) if behind else None)


def _reap(proc: subprocess.Popen[bytes], run_id: str) -> int:
    """torchrun's exit status after the hang kill, waiting at most KILL_REAP_S: an agent in D
    state (a hung NFS) cannot die until its I/O returns, and must not block the restart."""
    try:
        return proc.wait(timeout=KILL_REAP_S)
    except subprocess.TimeoutExpired:
        log.warning("run %s: torchrun (pid %d) has not exited %.0f s after the hang kill (uninterruptible I/O?): "
                    "going on without it", run_id, proc.pid, KILL_REAP_S)
        return -signal.SIGKILL


def _peer_hang(root: Path, run_id: str, nonce: str) -> Hang | None:
    record = read_hang(root, run_id, nonce)
    if record is None:
        return None
    return Hang(tuple(int(r) for r in record["ranks"]), str(record.get("phase", "step")), int(record["step"]),
                float(record.get("silent_s") or 0), float(record.get("budget_s") or 0), 0.0, {})


def _summary_key(run_id: str, env: dict[str, str]) -> str:
    """`<job key>.node-<n>`: one summary per node of a job, replaced by each run on it."""
    return run_id.rsplit(".", 2)[0] + f".node-{env.get('SLURM_NODEID', '0')}"


def _handle_hang(hang: Hang, watch: HangWatch, agent: int, tree: dict[int, int], root: Path, run_id: str,
                 dumps: Path, env: dict[str, str]) -> float:
    """Stacks first (every rank), then the event, then the kill (the whole tree: agent, ranks,
    DataLoader workers). Returns when the kill was sent."""
    sig = signal.Signals[env.get(ENV_DUMP_SIGNAL, "SIGUSR2")]
    detected = time.monotonic()  # latencies against the heartbeat's monotonic time
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    folder, dump_s = watch.dump(hang, worker_pids(agent), dumps / f"hang-{stamp}", sig)
    log.warning("hang: rank(s) %s silent %.1f s in %s after step %d (budget %.1f s); stacks in %s",
                list(hang.ranks), hang.silent_s, hang.phase, hang.step, hang.budget_s, folder)
    try_append_event(root, EV_HANG, run_id=run_id, ranks=list(hang.ranks), over_budget=list(hang.over),
                     phase=hang.phase, step=hang.step,
                     silent_s=hang.silent_s, budget_s=hang.budget_s,
                     detect_latency_s=round(detected - hang.last_heartbeat, 3),
                     beyond_budget_s=round(detected - hang.last_heartbeat - hang.budget_s, 3),
                     dump_s=dump_s, dump_dir=str(folder), rank_states={str(r): v for r, v in hang.ranks_state.items()},
                     host=os.uname().nodename)
    watch.publish(root, _summary_key(run_id, env), time.monotonic(), force=True)
    try:
        write_hang(root, run_id, {"ranks": list(hang.ranks), "step": hang.step, "phase": hang.phase,
                                  "silent_s": hang.silent_s, "budget_s": hang.budget_s, "dump_dir": str(folder),
                                  "nonce": env.get(ENV_NONCE, "")})
    except (OSError, ValueError) as exc:
        log.warning("could not write the hang record of run %s: %s", run_id, exc)
    killed = time.time()
    kill_tree(tree)
    return killed


def _classify_stop(relay: Relay, clock: JobClock | None, root: Path, run_id: str) -> str | None:
    if signal.SIGINT in relay.pending:
        try_append_event(root, EV_INTERRUPTED, run_id=run_id)
        return "interrupt"
    if signal.SIGTERM in relay.pending and relay.term_at is not None:
        stop = clock.classify_term(relay.term_at) if clock is not None else "cancel"
        try_append_event(root, "sigterm", run_id=run_id, meaning=stop)
        return stop
    return None


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _latest_step(root: Path) -> int | None:
    """The newest committed step, by its marker alone: a step the launcher cannot parse (a newer
    format, over a read cap) still means there is work to resume, so the job is requeued and the
    ranks, which read it, say what is wrong (never a "no checkpoint" give-up)."""
    return newest_committed(root)


def run_id_for(job_key: str, restart: int, attempt: int) -> str:
    """The same on every node of a run (the rank that writes the exit event may live on any
    node), different for each restart and each retry after a failure."""
    return f"{job_key}.{restart}.{attempt}"


def warn_signal(name: str) -> signal.Signals:
    return parse_signal(name.removeprefix("B:"))

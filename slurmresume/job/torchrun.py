"""One torchrun run on this node, for the node launcher (node.py's `NodeLauncher`): starts torchrun,
keeps it alive on the warning signal, makes sure every worker hears the signal, and says what the
run left (`run_torchrun` -> `RunResult`), from which `decision.decide` picks requeue, retry or stop.

Why forward at all: under proctrack/cgroup Slurm signals only the srun task (this process),
never torchrun's agent or the workers; and an unhandled SIGUSR1 would kill the agent. So torchrun
starts with the warning signal ignored (inherited across exec; each worker installs its own
handler), and this process relays the signal to the worker processes itself.

torchrun runs in its own session (a Ctrl-C in the terminal reaches only this launcher, which turns
it into a best-effort save), and a guardian process kills the whole tree if this launcher dies.

What a run did is read from the contract (`contract.read_outcome`, written by rank 0), the exit
code and the commit markers on disk; never from the event log.

The run loop lives here; its parts beside it (re-exported from here): `decision` (RunResult and
the pure `decide`), `relay` (the flag-only signal handlers, the worker pids), `jobclock` (Slurm's
EndTime and KillWait, the time limit told from a cancel).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hangwatch import HangWatch

from ..checkpoint.store import newest_committed
from ..contract import (
    ENV_DUMP_SIGNAL,
    ENV_NONCE,
    FAILSAVE_SUBDIR,
    parse_signal,
    read_hang,
    read_mirror_behind,
    read_outcome,
    write_hang,
)
from ..events import (
    EV_HANG,
    EV_INTERRUPTED,
    EV_RESUMED,
    EV_SIGNAL_FORWARDED,
    EV_SIGTERM,
    try_append_event,
)
from ..identity import start_ticks
from .deathboard import DeathBoard
from .decision import RunResult as RunResult
from .decision import decide as decide
from .guardian import Guardian, kill_tree
from .hang import Hang, failsave_victims
from .jobclock import JobClock as JobClock
from .relay import Relay as Relay
from .relay import worker_pids as worker_pids

log = logging.getLogger("slurmresume")

POLL_S = 0.1  # the relay loop's period: hang watch, heartbeat summary, re-sends
KILL_REAP_S = 30.0  # the longest the launcher waits for torchrun to exit after a hang kill
FAILSAVE_GRACE_S = 40.0  # after killing the hung rank: the others' failure save (status wait, write, exit)
RELAY_EVERY = 1.0  # seconds between re-sends while workers have not acted (start-up race)


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
                 dumps: Path | None = None, lost: Callable[[], bool] | None = None,
                 board: DeathBoard | None = None) -> RunResult:
    """Start torchrun (own session, tracked by the guardian), relay signals to its workers until
    it exits, classify the outcome. A SIGTERM is a cancel, or with a `clock` (Slurm) possibly the
    time limit: then the run is not waited for beyond half of KillWait (no new commit can land
    in time; the requeue that follows kills it). With a `watch`: a rank silent beyond its phase's
    budget makes every rank dump its stacks (under `dumps`), a `hang` event, and the whole tree
    killed; the result then carries the hang. `lost()` true (the root's lease now names another
    run): the tree is killed at once, since nothing it saves may commit there any more. With a
    `board` (several nodes): a death another node posts wakes this node's ranks (job/deathboard.py)."""
    latest_before = _latest_step(root)
    setup = guardian.preexec(_child_setup(warn)) if guardian is not None else _child_setup(warn)  # guardian.py
    proc = subprocess.Popen(cmd, env=env, preexec_fn=setup, stdout=log_file, stderr=log_file, start_new_session=True)
    tree = {proc.pid: start_ticks(proc.pid) or 0}
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
            if board is not None:
                board.poll(time.monotonic(), sorted(watch.records) if watch is not None else None)
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
                        try_append_event(root, EV_SIGNAL_FORWARDED, signal=signal.Signals(sig).name, workers=len(pids),
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
                     mirror_behind=(behind.get("step"), str(behind.get("error") or "?")) if behind else None,
                     last_step=watch.last_step() if watch is not None else None,
                     dead_steps=tuple(sorted(watch.dead_steps.items())) if watch is not None else (),
                     lost_nodes=tuple(sorted(board.lost)) if board is not None else ())


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
    _failure_save_first(hang, watch, agent, tree, run_id)
    kill_tree(tree)
    return killed


def _failure_save_first(hang: Hang, watch: HangWatch, agent: int, tree: dict[int, int], run_id: str) -> None:
    """Before the whole tree goes: SIGKILL the hung rank(s) alone (`failsave_victims`), so that the
    others, which stand at their last boundary, make the failure-time save and exit by themselves
    (train/failsave.py; torchrun stops once they have). At most FAILSAVE_GRACE_S."""
    directory = watch.directory
    if directory is None:
        return
    guarded = {int(p.stem.removeprefix("pid-")) for p in (directory / FAILSAVE_SUBDIR).glob("pid-*.json")
               if p.stem.removeprefix("pid-").isdigit()}
    victims = failsave_victims(hang, guarded)
    pids = {r: rec.pid for r in victims if (rec := watch.records.get(r)) is not None}
    if not victims or len(pids) != len(victims):
        return
    log.warning("hang: killing rank(s) %s first, so the others save step %d before the run is killed",
                list(victims), hang.step)
    for pid in pids.values():
        known = {pid: start_ticks(pid) or 0}
        kill_tree(known)
    deadline = time.monotonic() + FAILSAVE_GRACE_S
    while time.monotonic() < deadline and _alive(agent):
        time.sleep(0.1)
    if _alive(agent):
        log.warning("run %s: the ranks did not end %.0f s after the hung rank was killed: killing the run",
                    run_id, FAILSAVE_GRACE_S)


def _alive(pid: int) -> bool:
    """The agent (our child) has not exited yet; a zombie has exited (it is reaped by `_reap`)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _classify_stop(relay: Relay, clock: JobClock | None, root: Path, run_id: str) -> str | None:
    if signal.SIGINT in relay.pending:
        try_append_event(root, EV_INTERRUPTED, run_id=run_id)
        return "interrupt"
    if signal.SIGTERM in relay.pending and relay.term_at is not None:
        stop = clock.classify_term(relay.term_at) if clock is not None else "cancel"
        try_append_event(root, EV_SIGTERM, run_id=run_id, meaning=stop)
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

"""What runs on each node: the torchrun command line, the workers' environment, and the loop that
turns run outcomes into requeues (Slurm) or local restarts (`--local`, as Slurm's requeue would)."""

from __future__ import annotations

import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import ownership, slurm
from ..contract import (
    ENV_DUMP_SIGNAL,
    ENV_HEARTBEAT_DIR,
    ENV_LAUNCHER_PID,
    ENV_MEMORY_DIR,
    ENV_MIRROR,
    ENV_NONCE,
    ENV_OWNER,
    ENV_RESTART,
    ENV_ROOT,
    ENV_RUN_ID,
    ENV_SIGNAL,
    ENV_SNAPSHOT_EVERY,
    EXIT_MIRROR_BEHIND,
    LAUNCHER_EXIT_REQUEUED,
    LastRun,
    dump_signal,
    parse_snapshot_every,
    prune_records,
    read_last_run,
    write_last_run,
)
from ..errors import SlurmError
from ..events import (
    EV_FAILED,
    EV_FINISHED,
    EV_GAVE_UP,
    EV_HELD,
    EV_MEMORY_PROMOTED,
    EV_NO_CHECKPOINT,
    EV_REQUEUE_FAILED,
    EV_REQUEUED,
    EV_RUN_ENDED,
    EV_STARTED,
    EV_STOPPED,
    EV_WARNED_WITHOUT_SAVE,
    process_started_at,
    try_append_event,
)
from . import deathboard
from .config import JobSpec
from .deathboard import DeathBoard
from .guardian import Guardian
from .hangwatch import HangWatch, heartbeat_dir
from .memroot import create as create_memory_root
from .memroot import remove as remove_memory_root
from .peercopy import PeerCopy, rate_from_env
from .promote import promote
from .torchrun import (
    JobClock,
    Relay,
    RunResult,
    decide,
    run_id_for,
    run_torchrun,
    warn_signal,
)

log = logging.getLogger("slurmresume")


def rdzv_port(job_id: str, override: int | None) -> int:
    """A port derived from the job id, so concurrent jobs on one node do not collide."""
    if override:
        return override
    digits = "".join(c for c in job_id if c.isdigit()) or "0"
    return 20000 + int(digits) % 20000


def torchrun_command(spec: JobSpec, *, nnodes: int, endpoint: str | None, rdzv_id: str) -> list[str]:
    """The torchrun command, as an argument list (never through a shell). On one node through
    `slurmresume.job.agent` (torchrun, then no interpreter teardown: the launcher's decision
    after a preemption does not wait for it); with several nodes plain torchrun (agent.py says why).

    A one-node Slurm job rendezvouses `static` on the same endpoint (its agent hosts the store,
    as with c10d): c10d sleeps a random 0-0.3 s before its first round to spread the nodes'
    joins, and on one node that sleep only delays every requeue's first step. `--standalone`
    (local runs) keeps c10d: its port is the kernel's pick, so nothing can race for it."""
    runner = "slurmresume.job.agent" if nnodes == 1 else "torch.distributed.run"
    cmd = [spec.python, "-m", runner, f"--nnodes={nnodes}",
           f"--nproc-per-node={spec.procs}", "--max-restarts=0"]
    if endpoint is None:
        cmd.append("--standalone")
    else:
        backend = "static" if nnodes == 1 else "c10d"
        cmd += [f"--rdzv-backend={backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    return cmd + [str(spec.script), *spec.script_args]


def worker_env(spec: JobSpec, run_id: str, restart: int, extra: dict[str, str] | None = None, *,
               first_run: bool = True) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.update(quiet_threads(env, spec.procs, first_run=first_run))
    env.update({
        ENV_LAUNCHER_PID: str(os.getpid()),
        ENV_ROOT: str(spec.ckpt_dir),
        ENV_SIGNAL: spec.warning_signal,
        ENV_RUN_ID: run_id,
        ENV_RESTART: str(restart),
        ENV_DUMP_SIGNAL: dump_signal(warn_signal(spec.signal)).name,
        "PYTHONUNBUFFERED": "1",
    })
    if spec.mirror:
        env[ENV_MIRROR] = spec.mirror
    return env


def quiet_threads(env: dict[str, str], procs: int, *, first_run: bool) -> dict[str, str]:
    """Pure: torchrun sets OMP_NUM_THREADS=1 for more than one process per node when it is unset,
    and says so in a 5-line banner. Every run after a job's first (a retry, a local restart, a
    requeue) gets that same value from us, so the banner is printed once per job, not per restart."""
    if first_run or procs <= 1 or "OMP_NUM_THREADS" in env:
        return {}
    return {"OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class NodeLauncher:
    """The callable submitit runs once per node (one task per node), and again after each requeue.
    `nonce`: this submission's (drawn when it is made, pickled with it, so the same on every node
    and every requeue; a reused job id of another submission has another)."""

    spec: JobSpec
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex)

    def __call__(self) -> dict[str, Any]:
        # First, before any Slurm call: a warning that lands during start-up must find our
        # handler (its default action would kill this process, and the job with it).
        relay = Relay(warn_signal(self.spec.signal))
        relay.install()
        try:
            logging.basicConfig(level=logging.INFO, format="%(asctime)s slurmresume %(message)s")
            job_id = os.environ.get("SLURM_JOB_ID", "0")
            restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
            node_id = int(os.environ.get("SLURM_NODEID", "0"))
            nnodes = int(os.environ.get("SLURM_NNODES", str(self.spec.nodes)))
            clock = JobClock.read(job_id)  # in the background: torchrun does not wait for slurmctld
            endpoint = f"{rdzv_host(nnodes)}:{rdzv_port(job_id, self.spec.rdzv_port)}"
            cmd = torchrun_command(self.spec, nnodes=nnodes, endpoint=endpoint, rdzv_id=job_id)
            return _loop(self.spec, cmd, relay, job_key=f"slurm-{job_id}", nonce=self.nonce, restart=restart,
                         first_node=node_id == 0, clock=clock, extra={"node": node_id, "nodes": nnodes, "job": job_id})
        finally:
            # submitit still pickles the result and exits: a warning that lands now (Slurm may send
            # it early) has nothing left to save and must not kill the task (sacct: FAILED)
            relay.uninstall(ignore_warning=True)


def run_local(spec: JobSpec, env: dict[str, str] | None = None, *, takeover: bool = False) -> dict[str, Any]:
    """`submit --local`: the same launcher and torchrun on this machine; a preemption restarts the
    run from the newest complete checkpoint, as Slurm's requeue would (each restart with a fresh
    `--max-failures` budget, as a requeued job has). SIGTERM and Ctrl-C (SIGINT) are a best-effort
    save and a stop; a second Ctrl-C kills the run at once. `takeover`: take the root's lease
    from an owner that is provably gone (ownership.py)."""
    relay = Relay(warn_signal(spec.signal))
    relay.install()
    try:
        cmd = torchrun_command(spec, nnodes=1, endpoint=None, rdzv_id="local")
        key = f"local-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return _loop(spec, cmd, relay, job_key=key, nonce=uuid.uuid4().hex, restart=0, first_node=True, clock=None,
                     extra={"node": 0, "nodes": 1, "job": "local"}, env=env, takeover=takeover)
    finally:
        relay.uninstall()


def _loop(spec: JobSpec, cmd: list[str], relay: Relay, *, job_key: str, nonce: str, restart: int, first_node: bool,
          clock: JobClock | None, extra: dict[str, Any], env: dict[str, str] | None = None,
          takeover: bool = False) -> dict[str, Any]:
    root = spec.ckpt_dir
    # One owner per root: the first node holds the lease (job key = owner id, so every requeue of
    # a Slurm job and every local restart is the same owner); the ranks check it ($SLURMRESUME_OWNER).
    # Records belong to this launch: the launcher believes only those carrying its nonce.
    env = {**(env or {}), ENV_OWNER: job_key, ENV_NONCE: nonce}
    lease = None
    local = clock is None
    failures = 0
    hangs = 0  # in-allocation restarts after a hang (--max-hangs), this allocation
    previous_hang: tuple[tuple[int, ...], int] | None = None
    recovering: tuple[float, str] | None = None  # (when the last run died or was killed, why)
    launcher_started_at = process_started_at()
    if restart and not local:  # a requeued job: its first step is logged (`resumed`) from our start
        recovering = (launcher_started_at or time.time(), "requeue")
    guardian = Guardian()
    memory = None
    try:
        lease = ownership.hold(root, job_key, takeover=takeover) if first_node else None
        # the memory tier (job/memroot.py): kept across this loop's restarts, removed in `finally`
        # whatever ends the job here (a Slurm requeue too: the next allocation may be other nodes)
        memory = _memory_root(spec, job_key, extra)  # "": none (not one this launcher's environment names)
        env = {**env, ENV_MEMORY_DIR: str(memory or ""), ENV_SNAPSHOT_EVERY: str(spec.snapshot_every)}
        if first_node:
            prune_records(root, job_key, time.time())  # other launches' records: never believed, now gone
        while True:
            run_id = run_id_for(job_key, restart, failures + hangs)
            try_append_event(root, EV_STARTED, restart=restart, run_id=run_id, job_key=job_key, local=local,
                             launcher_started_at=launcher_started_at, **extra)
            log.info("run %s: %s", run_id, " ".join(cmd))
            watch = _watch(spec, run_id, recovering)
            watch.memory = memory  # published for `status` with the ranks' view
            hb = {ENV_HEARTBEAT_DIR: str(watch.directory)} if watch.directory is not None else {}
            board = _board(root, run_id, watch.directory, extra, first_node)
            hb.update(board.env() if board is not None else {})
            copy = _peer_copy(memory, board, extra)
            wenv = worker_env(spec, run_id, restart, {**env, **hb}, first_run=restart == 0 and failures + hangs == 0)
            try:
                result = run_torchrun(cmd, wenv, root, run_id, relay.warn, relay, clock=clock, guardian=guardian,
                                      watch=watch, dumps=spec.logs / run_id,
                                      lost=(lambda: lease.lost) if lease is not None else None, board=board)
            finally:
                watch.close()
                if copy is not None:
                    copy.close()
                if board is not None:
                    board.close()
            if result.lost_nodes and memory is not None and board is not None:
                _promote(root, board, memory, extra, result.lost_nodes, run_id)
            last = read_last_run(root, job_key, nonce)
            action, reason = decide(result, first_node=first_node, requeues_done=restart,
                                    max_requeues=spec.max_requeues, failures_done=failures,
                                    max_failures=spec.max_failures,
                                    previous_progressed=last.progressed if last is not None else None,
                                    hangs_done=hangs, max_hangs=spec.max_hangs, previous_hang=previous_hang)
            if lease is not None and not lease.still_held():  # never requeue into a root another run owns
                action, reason = "give_up", f"this run ({job_key}) lost checkpoint root {root} to another run"
            _record(root, result, action, reason, run_id, job_key, restart, first_node, nonce)
            log.info("run %s ended %s: %s -> %s", run_id, result.kind, reason, action)
            if lease is not None and (action in ("finish", "stop", "give_up", "behind") or (action == "hold" and local)):
                lease.release()  # the job will not come back: the root is free
            if action in ("finish", "stop"):
                return {"action": action, "reason": reason, "restarts": restart, "step": result.latest_after,
                        "kind": result.kind}
            if action == "give_up":
                raise SystemExit(f"slurmresume: giving up: {reason}")
            if action == "behind":  # the job ends non-zero, not requeued: nothing left to train
                print(f"slurmresume: {reason}", file=sys.stderr, flush=True)
                raise SystemExit(EXIT_MIRROR_BEHIND)
            if action == "hold":
                _hold(root, clock if first_node else None, extra["job"], job_key, reason)
            if action == "retry":
                recovering = (result.ended_at or time.time(), "hang" if result.kind == "hung" else "failure")
                if result.hang is not None:
                    hangs += 1
                    previous_hang = result.hang.key
                else:
                    failures += 1
                continue
            restart += 1
            if local:
                try_append_event(root, EV_REQUEUED, restart=restart, job_key=job_key, reason=reason, local=True)
                recovering = (result.ended_at or time.time(), "requeue")
                relay.pending.clear()
                failures = hangs = 0  # a requeued Slurm job starts with fresh budgets too
                previous_hang = None
                continue
            assert clock is not None
            _requeue(root, clock, relay, extra["job"], restart, job_key, reason)
    finally:
        guardian.close()
        remove_memory_root(memory)
        if lease is not None:
            lease.stop()


def _board(root: Path, run_id: str, local: Path | None, extra: dict[str, Any], first_node: bool) -> DeathBoard | None:
    """Several nodes: where this run's survivors meet after an unwarned death (job/deathboard.py).
    None on one node (its ranks see every death themselves) or without a node-local directory."""
    if int(extra.get("nodes", 1)) < 2 or local is None:
        return None
    if first_node:
        deathboard.sweep(root, keep=run_id)
    try:
        return DeathBoard(root, run_id, local, int(extra.get("node", 0)), int(extra["nodes"]))
    except OSError as exc:
        log.warning("no failure save across nodes for run %s: %s", run_id, exc)
        return None


def _peer_copy(memory: Path | None, board: DeathBoard | None, extra: dict[str, Any]) -> PeerCopy | None:
    """Several nodes with a memory tier: this node's snapshots copied to the next node, and the
    previous node's kept here (job/peercopy.py), for this run. None on one node, without a memory
    root or with $SLURMRESUME_PEER_COPY_MBS=0."""
    rate = rate_from_env()
    if memory is None or board is None or rate is None:
        return None
    try:
        return PeerCopy(memory, board.dir, int(extra.get("node", 0)), int(extra["nodes"]), rate).start()
    except OSError as exc:
        log.warning("no peer copy of the memory tier for this run: %s", exc)
        return None


def _promote(root: Path, board: DeathBoard, memory: Path, extra: dict[str, Any], lost: tuple[int, ...],
             run_id: str) -> None:
    """A run that lost nodes, before its requeue: the survivors' memory and the lost nodes' replicas
    committed to the root as one step when they hold one whole (job/promote.py), so that the
    requeued job loses at most the steps since that snapshot; the committer logs it."""
    node = int(extra.get("node", 0))
    done = promote(root, board.dir, memory, node, int(extra["nodes"]), set(lost))
    if done["committed"] is not None:
        log.info("memory tier after losing node(s) %s: %s", ", ".join(map(str, lost)),
                 f"step {done['step']} committed" if done["committed"] else f"nothing committed ({done['why']})")
        try_append_event(root, EV_MEMORY_PROMOTED, run_id=run_id, node=node, lost=list(lost), **done)


def _memory_root(spec: JobSpec, job_key: str, extra: dict[str, Any]) -> Path | None:
    """This node's memory-tier root, or None: `--snapshot-every off` or no tmpfs. On several nodes
    each node has its own, holding its ranks' shards of each snapshot (train/memtier.py)."""
    if parse_snapshot_every(spec.snapshot_every) == 0:
        return None
    return create_memory_root(job_key, int(extra.get("node", 0)))


def _watch(spec: JobSpec, run_id: str, recovering: tuple[float, str] | None) -> HangWatch:
    """This node's ranks' hang watch for one run; the save budget starts from the log's recent saves.
    Which ranks are this node's is learned from the agent's children and the records (hangwatch.py),
    never computed from SLURM_NODEID: torchrun's rendezvous orders nodes its own way."""
    from ..events import read_events, save_seconds

    saves = save_seconds(read_events(spec.ckpt_dir)[-200:])
    directory = heartbeat_dir(run_id, spec.procs, spec.ckpt_dir)
    return HangWatch(directory, spec.budgets, procs=spec.procs, save_cost_s=max(saves[-20:], default=0.0),
                     recovering=recovering, root=spec.ckpt_dir)


def _hold(root: Path, clock: JobClock | None, job: str, job_key: str, reason: str) -> None:
    """The same hang twice: stop here. Under Slurm the job is held in the queue (`scontrol
    requeuehold`: not failed, not rerun until `scontrol release`), so the allocation is not burnt
    on a third identical hang and nothing is lost; locally (clock None), and on the other nodes
    (the first node holds the job), the run simply stops."""
    try_append_event(root, EV_HELD, job_key=job_key, reason=reason)
    if clock is None:
        raise SystemExit(f"slurmresume: stopping: {reason}")
    sys.stdout.flush()
    try:
        slurm.run(["scontrol", "requeuehold", job], timeout=30.0)
    except SlurmError as exc:
        raise SystemExit(f"slurmresume: stopping: {reason} (scontrol requeuehold failed: {exc})") from None
    log.info("job %s held: %s", job, reason)
    raise SystemExit(LAUNCHER_EXIT_REQUEUED)


def _requeue(root: Path, clock: JobClock, relay: Relay, job: str, restart: int, job_key: str, reason: str) -> None:
    """`scontrol requeue`, retried until KillWait after a SIGTERM (or REQUEUE_BUDGET_S); logged
    only once it worked; then exit at once (the job is REQUEUED: no clean exit, no sleep)."""
    began = time.time()
    sys.stdout.flush()
    try:
        errors = slurm.requeue_with_retry(job, lambda: clock.requeue_deadline(relay, began), clock=time.time)
    except SlurmError as exc:
        try_append_event(root, EV_REQUEUE_FAILED, restart=restart, job_key=job_key, error=str(exc),
                         seconds=round(time.time() - began, 2))
        raise SystemExit(f"slurmresume: the requeue failed, the job ends here: {exc}") from None
    try_append_event(root, EV_REQUEUED, restart=restart, job_key=job_key, reason=reason, attempts=len(errors) + 1,
                     errors=errors or None)
    log.info("requeued (%d attempt(s)); exiting", len(errors) + 1)
    raise SystemExit(LAUNCHER_EXIT_REQUEUED)


def _record(root: Path, result: RunResult, action: str, reason: str, run_id: str, job_key: str,
            restart: int, first_node: bool, nonce: str) -> None:
    if not first_node and action == "stop":
        return
    # for `status` (tools/failures.py): how far the ranks got, and who died first at which step
    dead = {str(r): s for r, s in result.dead_steps} if result.kind == "failed" and result.dead_steps else None
    try_append_event(root, EV_RUN_ENDED, run_id=run_id, job_key=job_key, restart=restart, outcome=result.kind,
                     returncode=result.returncode, saved_step=result.saved_step, latest=result.latest_after,
                     progressed=result.progressed, lost_steps=result.lost_steps, action=action, reason=reason,
                     last_step=result.last_step, dead_steps=dead)
    try:
        write_last_run(root, LastRun(job_key, run_id, result.kind, action, result.progressed, result.latest_after,
                                     result.lost_steps, nonce))
    except OSError as exc:
        log.warning("could not write the run record under %s: %s", root, exc)
    loud = None
    if result.kind == "warned_without_save":
        loud = EV_WARNED_WITHOUT_SAVE
    elif action == "finish" and result.latest_after is None:
        loud = EV_NO_CHECKPOINT
    if loud:
        try_append_event(root, loud, run_id=run_id, job_key=job_key, reason=reason)
        print(f"slurmresume: WARNING: {reason}", file=sys.stderr, flush=True)
    terminal = {"finish": EV_FINISHED, "behind": EV_FINISHED, "give_up": EV_GAVE_UP, "stop": EV_STOPPED}.get(action)
    if terminal:
        try_append_event(root, terminal, reason=reason, step=result.latest_after, job_key=job_key)
    if result.kind == "failed":
        try_append_event(root, EV_FAILED, returncode=result.returncode, job_key=job_key, reason=reason)


def rdzv_host(nnodes: int) -> str:
    """Where torchrun's rendezvous store listens: this node on a one-node job (no `scontrol`
    call before torchrun starts), else the allocation's first node."""
    return "127.0.0.1" if nnodes == 1 else _first_node_addr()


def _first_node_addr() -> str:
    """Address of the allocation's first node (NodeAddr, so emulated nodes resolve too)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST", "")
    if not nodelist:
        return "127.0.0.1"
    first = slurm.hostnames(nodelist)[0]
    try:
        out = slurm.run(["scontrol", "show", "node", first, "-o"]).stdout
        for tok in out.split():
            if tok.startswith("NodeAddr="):
                return tok.split("=", 1)[1]
    except Exception:  # noqa: BLE001 - fall back to the name; torchrun will say if it fails
        pass
    return first

"""The launcher's side of the heartbeat channel: read this node's ranks' records on the shared
monotonic clock, judge them (hang.judge, pure), and when a rank is stuck dump every rank's stacks
before the run is killed. Also publishes a small per-node summary to the shared root for `status`
(the heartbeat files themselves are node-local), and measures the time from a death or a kill to
the first step of the next run.

Which ranks: those this launcher's own agent started, never a range computed from SLURM_NODEID
(torchrun's c10d rendezvous numbers nodes by sorting host names and agent pids, not by Slurm's
order). They are learned from the agent's children (their RANK in /proc/<pid>/environ) and from
the records that appear in this node's directory; a rank with no record is "unknown", and one
whose writes failed is "not watched": both are shown, neither is ever judged.

Dumps go to `<log dir>/<run id>/hang-<UTC time>/rank-<r>.txt`: a header (rank, pid, phase, last
step, seconds silent), every thread's Python stack from faulthandler (the rank registered it on
the dump signal, heartbeat.dump_signal), and `py-spy dump` output when py-spy is installed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..beatfile import RESTORE, SAVE, SIZE, STEP, Record, scan, stacks_path
from ..contract import RUNS_DIR
from .hang import UNKNOWN, UNWATCHED, Hang, HangBudgets, budget, judge, percentile, restoring_io_s
from .hbsweep import PREFIX, owner_tag, sweep
from .memroot import view as memory_view

log = logging.getLogger("slurmresume")

DUMP_WAIT_S = 5.0  # the longest the launcher waits for the ranks' faulthandler output
DUMP_QUIET_S = 0.3  # a stacks file unchanged this long is complete
PYSPY_TIMEOUT_S = 15.0
PUBLISH_EVERY_S = 10.0
UNWATCHED_AFTER_S = 1.0  # a record file still empty this long after it was first seen: not watched
IO_SAMPLE_S = 1.0  # while a rank saves: how often the bytes of the saves in progress are summed
PROBE_PAGE = 4096  # a tmpfs allocates whole pages: each rank's record and stacks file takes at least one


def heartbeat_dir(run_id: str, procs: int = 1, root: Path | None = None) -> Path | None:
    """A fresh node-local directory for one run, private to this user (0700): the first of
    /dev/shm (RAM, no disk I/O), $TMPDIR, and `<root>/.runs/heartbeats/<host>/` where a probe
    can really write what `procs` ranks need (a full tmpfs passes os.access, and then every
    pwrite fails with ENOSPC). None, with one warning line, when none can: the run goes
    unwatched. Its name carries this launcher's `hbsweep.owner_tag`; directories in the same base
    whose launcher is gone (SIGKILLed: it could not remove its own) are removed first."""
    tag = owner_tag()
    bases = [Path("/dev/shm"), Path(tempfile.gettempdir())]
    if root is not None:
        bases.append(Path(root) / RUNS_DIR / "heartbeats" / os.uname().nodename)
    failures = []
    for base in bases:
        try:
            base.mkdir(parents=True, exist_ok=True)
            gone = sweep(base)
            if gone:
                log.info("removed %d heartbeat directories of launchers that are gone, under %s", len(gone), base)
            directory = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{run_id}-{tag + '-' if tag else ''}", dir=base))
        except OSError as exc:
            failures.append(f"{base}: {exc.strerror or exc}")
            continue
        error = _probe(directory, 2 * max(procs, 1) * max(SIZE, PROBE_PAGE))
        if error is None:
            return directory
        shutil.rmtree(directory, ignore_errors=True)
        failures.append(f"{base}: {error}")
    log.warning("hang watch off for run %s: no heartbeat directory could be written (%s)", run_id,
                "; ".join(failures))
    return None


def _probe(directory: Path, size: int) -> str | None:
    """Write `size` bytes into `directory` and remove them; the error, or None when it worked."""
    path = directory / ".probe"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            if os.pwrite(fd, b"\0" * size, 0) != size:
                return "short write"
            os.fsync(fd)
        finally:
            os.close(fd)
        return None
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        try:
            path.unlink()
        except OSError:
            pass


def ranks_of(pids: list[int]) -> dict[int, int]:
    """pid -> global rank, from each process's RANK (torchrun sets it) in /proc/<pid>/environ."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read(1 << 20).split(b"\0")
        except OSError:
            continue
        for item in env:
            if item.startswith(b"RANK=") and item[5:].isdigit():
                out[pid] = int(item[5:])
                break
    return out


class HangWatch:
    """One per run on each node. `poll()` from the launcher's loop (every 0.1 s) with
    time.monotonic() and the agent's current children. `directory` None: nothing is watched
    (no writable heartbeat directory), the ranks are still listed."""

    def __init__(self, directory: Path | None, budgets: HangBudgets, *, procs: int = 0, save_cost_s: float = 0.0,
                 recovering: tuple[float, str] | None = None, root: Path | None = None) -> None:
        self.directory = directory
        self.root = root  # the checkpoint root: a save in progress there whose bytes move is alive
        self.memory: Path | None = None  # this node's memory-tier root (job/memroot.py): its view is published
        self._io: tuple[float, int] | None = None  # (when sampled, bytes of the saves in progress)
        self.io_at: float | None = None  # when those bytes last moved (monotonic)
        self.procs = procs  # ranks this node's agent starts (display only: which ones is learned)
        self.budgets = budgets
        self.save_cost_s = save_cost_s
        self.records: dict[int, Record | None] = {}  # every rank seen: its record, None when it has none
        self.rank_pids: dict[int, int] = {}  # pid -> rank of the agent's children seen so far
        self.live: set[int] = set()  # the agent's children at the last poll
        self.unwatched: set[int] = set()
        self._empty_since: dict[int, float] = {}
        self.recovering = recovering  # (time.time() of the death/kill that ended the previous run, cause)
        self.resumed: dict[str, Any] | None = None  # set once: {seconds, step, cause}
        self.resumed_logged = False
        self.seen_pids: set[int] = set()
        self.death_at: float | None = None  # time.time() a worker vanished while torchrun still ran
        self.dead_steps: dict[int, int] = {}  # the ranks that vanished first: their last heartbeat step
        self._published: float | None = None

    def refresh(self, now: float | None = None) -> None:
        """Re-read the records; learn new ranks from them and from the agent's children."""
        found, empty = scan(self.directory) if self.directory is not None else ({}, set())
        known = set(self.records) | set(found) | empty | set(self.rank_pids.values())
        self.records = {r: found.get(r) for r in sorted(known)}
        now = time.monotonic() if now is None else now
        for rank in sorted(empty - set(found)):
            since = self._empty_since.setdefault(rank, now)
            if rank not in self.unwatched and now - since >= UNWATCHED_AFTER_S:
                self.unwatched.add(rank)
                log.warning("hang watch: rank %d cannot write its heartbeat: not watched (never killed for it)",
                            rank)
        self.unwatched -= set(found)

    def poll(self, now: float, pids: list[int]) -> Hang | None:
        """`now`: time.monotonic(). Judges the ranks whose processes are alive (a rank that has
        exited, early or not, is not judged; the others are judged as before)."""
        current = set(pids)
        new = [p for p in pids if p not in self.rank_pids]
        if new:
            self.rank_pids.update(ranks_of(new))
        self.refresh(now)
        if self.death_at is None and self.seen_pids - current:
            self.death_at = time.time()
            gone = {self.rank_pids[p] for p in self.seen_pids - current if p in self.rank_pids}
            self.dead_steps = {r: rec.step for r in sorted(gone) if (rec := self.records.get(r)) is not None}
        self.seen_pids |= current
        self.live = current
        if self.recovering is not None and self.resumed is None:
            first = [rec for rec in self.records.values() if rec is not None and rec.phase == STEP]
            if first:
                at = min(rec.wall - (rec.time - rec.phase_since) for rec in first)  # wall time, for the log
                self.resumed = {"seconds": round(at - self.recovering[0], 3), "cause": self.recovering[1],
                                "first_step_at": round(at, 3),
                                "step": min(rec.step for rec in first)}
        alive = {r: rec for r, rec in self.records.items() if rec is None or rec.pid in current}
        if any(rec is not None and rec.phase in (SAVE, RESTORE) for rec in alive.values()):
            self._sample_io(now)
        return judge(alive, now, self.budgets, self.save_cost_s, frozenset(self.unwatched), self.io_at)

    def last_step(self) -> int | None:
        """The furthest step boundary any of this node's ranks reported (its heartbeats): what the
        run had trained when it ended, for the `run_ended` event (None: no rank reported one)."""
        steps = [rec.step for rec in self.records.values() if rec is not None and rec.step >= 0]
        return max(steps, default=None)

    def _sample_io(self, now: float) -> None:
        """Every IO_SAMPLE_S while a rank saves or restores: the bytes of the root's saves and
        mirror pulls in progress."""
        if self.root is None or (self._io is not None and now - self._io[0] < IO_SAMPLE_S):
            return
        total = _saving_bytes(self.root)
        if self._io is not None and total != self._io[1]:
            self.io_at = now
        self._io = (now, total)

    def dump(self, hang: Hang, pids: list[int], out: Path, sig: signal.Signals) -> tuple[Path, float]:
        """Every local rank's stacks into `out` (created); returns (out, seconds it took)."""
        began = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
        assert self.directory is not None  # a hang comes only from a record in it
        by_rank = {rank: rec for rank, rec in self.records.items() if rec is not None and rec.pid in pids}
        sizes = {rank: _size(stacks_path(self.directory, rank)) for rank in by_rank}
        for rec in by_rank.values():
            try:
                os.kill(rec.pid, sig)
            except OSError:
                pass
        spies = _start_pyspy([rec.pid for rec in by_rank.values()])
        _wait_quiet([stacks_path(self.directory, r) for r in by_rank], sizes, began + DUMP_WAIT_S)
        spied = _collect_pyspy(spies)
        for rank in sorted(self.records):
            last = self.records.get(rank)
            state = hang.ranks_state.get(rank, {})
            mark = (" (HUNG: over its budget, at the lowest step)" if rank in hang.ranks else
                    " (silent too, but past the hung rank's step: waiting for it)" if rank in hang.over else "")
            head = [f"rank {rank}{mark}",
                    f"pid {last.pid if last else 'unknown (no heartbeat yet)'}",
                    f"phase {state.get('phase')}, last step {state.get('step')}, silent {state.get('age_s')} s",
                    ""]
            body = ""
            if rank in by_rank:
                body = _read_from(stacks_path(self.directory, rank), sizes[rank]) or \
                    "(faulthandler wrote nothing within the wait)\n"
                if last is not None and last.pid in spied:
                    body += "\n--- py-spy dump ---\n" + spied[last.pid]
            else:
                body = ("(not watched: its heartbeat writes failed)\n" if rank in self.unwatched else
                        "(no heartbeat from this rank: it had not created its Checkpointer, it cannot write its "
                        "heartbeat, or it is gone)\n")
            (out / f"rank-{rank}.txt").write_text("\n".join(head) + "\n" + body)
        return out, round(time.monotonic() - began, 3)

    def summary(self, now: float) -> dict[str, Any]:
        """Per rank: last step, its age, phase, step-time median and p99, its budget now (seconds;
inf: never judged, e.g. done), the bytes of a save/restore/pull in progress. `now`:
        time.monotonic(); "time" fields are wall clock, for display."""
        ranks: dict[str, Any] = {}
        peer_io_s = restoring_io_s(self.records, self.budgets)
        for rank, rec in self.records.items():
            if rec is None or rank in self.unwatched:
                ranks[str(rank)] = {"step": None, "phase": UNWATCHED if rank in self.unwatched else UNKNOWN,
                                    "age_s": None}
                continue
            d = list(rec.durations)
            allowed = budget(rec, self.budgets, self.save_cost_s, peer_io_s)[1]
            ranks[str(rank)] = {"step": rec.step, "phase": rec.phase, "age_s": round(now - rec.time, 1),
                                "time": rec.wall, "median_s": percentile(d, 50), "p99_s": percentile(d, 99),
                                "samples": len(d), "longest_step_s": round(rec.longest_step, 4),
                                "longest_save_s": round(rec.longest_save, 4),
                                "budget_s": round(allowed, 1) if allowed < float("inf") else None,
                                "moving_bytes": rec.expect_bytes, "rate_bps": round(rec.rate)}
        return {"time": time.time(), "host": os.uname().nodename, "budgets": self.budgets.describe(),
                "procs": self.procs, "watched": self.directory is not None, "ranks": ranks,
                "memory": memory_view(self.memory)}

    def publish(self, root: Path, key: str, now: float, force: bool = False) -> None:
        """Every PUBLISH_EVERY_S (or now; `now`: time.monotonic()): `<root>/.runs/<key>.ranks.json`,
        atomically (no fsync: it is a view for `status`, rewritten soon)."""
        if not force and self._published is not None and now - self._published < PUBLISH_EVERY_S:
            return
        self._published = now
        path = Path(root) / RUNS_DIR / f"{key}.ranks.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.summary(now), separators=(",", ":")))
            os.replace(tmp, path)
        except OSError:
            pass

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)


def _saving_bytes(root: Path) -> int:
    """Bytes (size + allocated) of every file in the root's saves in progress (layout.saving_dirs)
    and pulls from the mirror in progress (`.mirror-download.*`, the restore's download), one level
    deep."""
    from ..checkpoint.layout import saving_dirs
    from ..checkpoint.leftovers import DOWNLOAD_PREFIX

    try:
        pulls = [Path(e.path) for e in os.scandir(root) if e.name.startswith(DOWNLOAD_PREFIX)]
    except OSError:
        pulls = []
    total = 0
    for path in [p for _, p in saving_dirs(root)] + pulls:
        try:
            with os.scandir(path) as entries:
                total += sum(_written(Path(e.path)) for e in entries if e.is_file(follow_symlinks=False))
        except OSError:
            pass
    return total


def _written(path: Path) -> int:
    """Size plus allocated bytes: a pull sets each shard's full size first (ftruncate) and then
    fills it, so only its allocated blocks show the bytes arriving."""
    try:
        st = path.stat()
    except OSError:
        return 0
    return st.st_size + 512 * st.st_blocks


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(4 << 20).decode(errors="replace")
    except OSError:
        return ""


def _wait_quiet(paths: list[Path], before: dict[int, int], deadline: float) -> None:
    """Until every file has grown and then not changed for DUMP_QUIET_S (or the deadline)."""
    sizes = {p: -1 for p in paths}
    quiet_since = time.monotonic()
    while time.monotonic() < deadline:
        now_sizes = {p: _size(p) for p in paths}
        grown = all(s > b for s, b in zip(now_sizes.values(), before.values(), strict=False))
        if now_sizes != sizes:
            sizes, quiet_since = now_sizes, time.monotonic()
        elif grown and time.monotonic() - quiet_since >= DUMP_QUIET_S:
            return
        time.sleep(0.05)


def _start_pyspy(pids: list[int]) -> dict[int, subprocess.Popen[str]]:
    exe = shutil.which("py-spy")
    if exe is None:
        return {}
    out = {}
    for pid in pids:
        try:
            out[pid] = subprocess.Popen([exe, "dump", "--pid", str(pid)], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        except OSError:
            pass
    return out


def _collect_pyspy(spies: dict[int, subprocess.Popen[str]]) -> dict[int, str]:
    out = {}
    deadline = time.monotonic() + PYSPY_TIMEOUT_S
    for pid, proc in spies.items():
        try:
            text, _ = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            out[pid] = text
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            out[pid] = f"(py-spy did not answer within {PYSPY_TIMEOUT_S:.0f} s)\n"
    return out

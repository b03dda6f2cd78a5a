"""The launcher's side of the heartbeat channel: read this node's ranks' records on the launcher's
clock, judge them (hang.judge, pure), and when a rank is stuck dump every rank's stacks before the
run is killed. Also publishes a small per-node summary to the shared root for `status` (the
heartbeat files themselves are node-local), and measures the time from a death or a kill to the
first step of the next run.

Dumps go to `<log dir>/<run id>/hang-<UTC time>/rank-<r>.txt`: a header (rank, pid, phase, last
step, seconds silent), every thread's Python stack from faulthandler (the rank registered it on
the dump signal, heartbeat.dump_signal), and `py-spy dump` output when py-spy is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from ..contract import RUNS_DIR
from ..train.heartbeat import STEP, Record, read_all, stacks_path
from .hang import Hang, HangBudgets, judge, percentile

DUMP_WAIT_S = 5.0  # the longest the launcher waits for the ranks' faulthandler output
DUMP_QUIET_S = 0.3  # a stacks file unchanged this long is complete
PYSPY_TIMEOUT_S = 15.0
PUBLISH_EVERY_S = 10.0


def heartbeat_dir(run_id: str) -> Path:
    """A fresh node-local directory for one run: /dev/shm when there is one (RAM, no disk I/O),
    else $TMPDIR. Private to this user (0700)."""
    base = Path("/dev/shm") if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else \
        Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=f"slurmresume-hb-{run_id}-", dir=base))


class HangWatch:
    """One per run on each node. `poll()` from the launcher's loop (every 0.1 s)."""

    def __init__(self, directory: Path, ranks: list[int], budgets: HangBudgets, *, save_cost_s: float = 0.0,
                 recovering: tuple[float, str] | None = None) -> None:
        self.directory = directory
        self.ranks = ranks
        self.budgets = budgets
        self.save_cost_s = save_cost_s
        self.started = time.time()
        self.records: dict[int, Record | None] = dict.fromkeys(ranks)
        self.recovering = recovering  # (time of the death/kill that ended the previous run, cause)
        self.resumed: dict[str, Any] | None = None  # set once: {seconds, step, cause}
        self.resumed_logged = False
        self.seen_pids: set[int] = set()
        self.death_at: float | None = None  # a worker vanished while torchrun still ran
        self._published = 0.0

    def refresh(self) -> None:
        found = read_all(self.directory)
        self.records = {r: found.get(r) for r in self.ranks}

    def poll(self, now: float, pids: list[int]) -> Hang | None:
        self.refresh()
        if self.death_at is None and self.seen_pids - set(pids):
            self.death_at = now
        self.seen_pids |= set(pids)
        if self.recovering is not None and self.resumed is None:
            first = [rec for rec in self.records.values() if rec is not None and rec.phase == STEP]
            if first:
                at = min(rec.phase_since for rec in first)
                self.resumed = {"seconds": round(at - self.recovering[0], 3), "cause": self.recovering[1],
                                "first_step_at": round(at, 3),
                                "step": min(rec.step for rec in first)}
        if self.death_at is not None:
            return None  # a rank died: torchrun tears the run down; that is a failure, not a hang
        return judge(self.records, now, self.started, self.budgets, self.save_cost_s)

    def dump(self, hang: Hang, pids: list[int], out: Path, sig: signal.Signals) -> tuple[Path, float]:
        """Every local rank's stacks into `out` (created); returns (out, seconds it took)."""
        began = time.monotonic()
        out.mkdir(parents=True, exist_ok=True)
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
        for rank in self.ranks:
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
                body = "(no heartbeat from this rank: it had not created its Checkpointer, or it is gone)\n"
            (out / f"rank-{rank}.txt").write_text("\n".join(head) + "\n" + body)
        return out, round(time.monotonic() - began, 3)

    def summary(self, now: float) -> dict[str, Any]:
        """Per rank: last step, its age, phase, step-time median and p99 (seconds)."""
        ranks = {}
        for rank, rec in self.records.items():
            if rec is None:
                ranks[str(rank)] = {"step": None, "phase": "start-up", "age_s": round(now - self.started, 1)}
                continue
            d = list(rec.durations)
            ranks[str(rank)] = {"step": rec.step, "phase": rec.phase, "age_s": round(now - rec.time, 1),
                                "time": rec.time, "median_s": percentile(d, 50), "p99_s": percentile(d, 99),
                                "samples": len(d), "longest_step_s": round(rec.longest_step, 4),
                                "longest_save_s": round(rec.longest_save, 4)}
        return {"time": now, "host": os.uname().nodename, "budgets": self.budgets.describe(), "ranks": ranks}

    def publish(self, root: Path, key: str, now: float, force: bool = False) -> None:
        """Every PUBLISH_EVERY_S (or now): `<root>/.runs/<key>.ranks.json`, atomically (no fsync:
        it is a view for `status`, rewritten soon)."""
        if not force and now - self._published < PUBLISH_EVERY_S:
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
        shutil.rmtree(self.directory, ignore_errors=True)


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

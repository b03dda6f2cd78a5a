"""The heartbeat channel from each rank to its node's launcher (the contract's ENV_HEARTBEAT_DIR),
on the rank's side: its writer (`Beat`), the phases of the training thread (`phase`, `expect_io`).

Every rank owns one fixed-size file, `<dir>/rank-<global rank>.hb`, in a node-local directory
the launcher creates per run (under /dev/shm when it exists, else $TMPDIR): no collective, no
shared filesystem, one `pwrite` per `ckpt.step()` (measured by scripts/bench_hang.py: a few
microseconds, far under 1% of a 50 ms step). The launcher `pread`s the files on its own clock.

A record says: which process (pid, rank), what it is doing (phase: start-up, step, save,
restore, busy (`ckpt.busy()`: an evaluation between steps), done), since when, the last step it
reported and when, the longest step and save it has measured in this run, the budget a `busy`
stretch asked for, the bytes the save, restore or mirror pull in progress has to move and the
throughput this process measured for that kind of I/O (`expect_io`: the launcher scales the
budget with them, hang.py), and a ring of its last RING step durations (status: median, p99). A seq
number at both ends of the record lets a reader drop a torn read (it retries once, then reports
nothing rather than a mix of two records).

Times: every age and budget is CLOCK_MONOTONIC (`time.monotonic()`: system-wide on Linux, so the
rank and its node's launcher share it, and an NTP step or a VM resume does not move it); the wall
time of the last heartbeat rides along for display only.

A rank whose write fails (a full tmpfs: `open` works, `pwrite` fails with ENOSPC) says so by
truncating its record to 0 bytes, logs one warning, and stops writing: the launcher shows it as
"not watched" and never judges it (an unwatchable rank is unwatched, not hung).

Stack dumps ride on the same directory: each rank registers `faulthandler` (all threads) on the
dump signal (`dump_signal`, never the warning signal), writing into `<dir>/rank-<r>.stacks`; the
launcher sends the signal before it kills a hung run and copies what was written.

The record's format is beatfile.py's (the launcher reads it there); the drill's injected hang is
drillhang.py's; the pull rate an earlier run logged is read by `events.logged_pull_rate`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import time
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from ..beatfile import (  # the record format, shared with the launcher (job/hang.py, job/hangwatch.py)
    FORMAT_VERSION,
    HEAD_STRUCT,
    IO_MEASURE_MIN_BYTES,
    MAGIC,
    PHASES,
    RING,
    RING_STRUCT,
    STARTUP,
    STEP,
    TAIL_STRUCT,
    record_path,
    stacks_path,
)
from ..contract import ENV_DUMP_SIGNAL, ENV_HEARTBEAT_DIR


class Beat:
    """The rank's writer. Cheap by construction: one struct pack and one pwrite per call.
    Not thread-safe: only the training thread beats (an async save's thread never does)."""

    def __init__(self, directory: Path, rank: int, warmup: int = 3) -> None:
        self.rank = rank
        self.warmup = warmup
        self.fd = os.open(record_path(directory, rank), os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        self.seq = 0
        self.phase = STARTUP
        self.step = -1
        self.last = time.monotonic()
        self.phase_since = self.last
        self.budget_s = 0.0
        self.expect_bytes, self.rate = 0, 0.0  # the I/O in progress (expect_io)
        self._expecting: tuple[str, int, float] | None = None  # (kind, bytes, since) being measured
        self.rates: dict[str, float] = {}  # kind -> the slowest throughput measured in this process
        self.failed = False  # a write failed: the record was emptied ("not watched"), no more writes
        self.longest_step = 0.0
        self.longest_save = 0.0
        self.steps_seen = 0
        self.ring = array("f", bytes(RING_STRUCT.size))  # written as is; the reader puts it in order
        self.ring_len = 0
        self._stacks: IO[str] | None = None
        self._dump_sig: signal.Signals | None = None
        self._write()

    def beat_step(self, step: int) -> None:
        """At ckpt.step(step)'s entry: the step just finished; its duration is measured from the
        previous heartbeat (the previous step()'s return, after any save it did)."""
        now = time.monotonic()
        if self.phase == STEP:
            took = now - self.last
            self.ring[self.ring_len % RING] = took
            self.ring_len += 1
            if self.steps_seen >= self.warmup and took > self.longest_step:
                self.longest_step = took
        else:
            self.phase, self.phase_since = STEP, now
        self.steps_seen += 1
        self.step = step
        self.last = now
        self._write()

    def enter(self, phase: str, budget_s: float = 0.0) -> float:
        """A save, a restore or a busy stretch begins (or the script is done); returns the
        (monotonic) time it began. `budget_s`: what a busy stretch asked for (0: the default)."""
        now = time.monotonic()
        self.phase, self.phase_since, self.last, self.budget_s = phase, now, now, budget_s
        self.expect_bytes, self.rate, self._expecting = 0, 0.0, None
        self._write()
        return now

    def expect(self, kind: str, nbytes: int, logged_rate: float = 0.0) -> None:
        """Inside a save or restore: `nbytes` are to be moved now (`kind`: save, restore or pull).
        Published with the slowest throughput this process measured for `kind`, else
        `logged_rate` (an earlier run's, from the log; 0: none), so the launcher can scale the
        budget; also a heartbeat (the work before it is done). The transfer announced before,
        if any, ends here and is measured."""
        now = time.monotonic()
        self._measure(now)
        self._expecting = (kind, max(int(nbytes), 0), now)
        rate = self.rates.get(kind) or max(logged_rate, 0.0)
        self.expect_bytes, self.rate, self.last = max(int(nbytes), 0), rate, now
        self._write()

    def _measure(self, now: float) -> None:
        if self._expecting is None:
            return
        kind, nbytes, since = self._expecting
        self._expecting = None
        if nbytes >= IO_MEASURE_MIN_BYTES and now > since:
            self.rates[kind] = min(self.rates.get(kind, float("inf")), nbytes / (now - since))

    def leave(self, began: float, measured_save: bool = False) -> None:
        """Back to stepping after a save/restore (a restore returns to start-up: step() has not
        been called since). The next step's duration is counted from here."""
        now = time.monotonic()
        if measured_save:
            self.longest_save = max(self.longest_save, now - began)
        self._measure(now)
        self.phase = STEP if self.steps_seen else STARTUP
        self.phase_since, self.last, self.budget_s = now, now, 0.0
        self.expect_bytes, self.rate = 0, 0.0
        self._write()

    def _write(self) -> None:
        if self.failed:
            return
        self.seq += 1
        data = (HEAD_STRUCT.pack(MAGIC, FORMAT_VERSION, self.seq, os.getpid(), self.rank, PHASES.index(self.phase),
                           self.steps_seen, self.ring_len, self.step, self.last, self.phase_since, self.longest_step,
                           self.longest_save, time.time(), self.budget_s, self.expect_bytes, self.rate)
                + self.ring.tobytes() + TAIL_STRUCT.pack(self.seq))
        try:
            if os.pwrite(self.fd, data, 0) == len(data):
                return
            error: OSError = OSError(f"short write to {self.fd}")
        except OSError as exc:
            error = exc
        self._unwatched(error)

    def _unwatched(self, error: OSError) -> None:
        """A write failed (never breaks training): empty the record, which tells the launcher this
        rank is "not watched" (a stale record would read as a hang), and stop writing."""
        import logging

        self.failed = True
        try:
            os.ftruncate(self.fd, 0)  # frees the space a full tmpfs lacks, so this works where pwrite did not
        except OSError:
            pass
        logging.getLogger("slurmresume").warning(
            "heartbeat write failed (%s): the hang watch does not watch rank %d for the rest of this run",
            error, self.rank)

    def register_dumps(self, directory: Path, sig: signal.Signals) -> None:
        """faulthandler on `sig`, all threads, into <dir>/rank-<r>.stacks (kept open). The
        registration is the process's: with two Beats (two Checkpointers) the newest holds it,
        and closing one hands it back to the other instead of unregistering it."""
        try:
            self._stacks = open(stacks_path(directory, self.rank), "a")  # noqa: SIM115 - faulthandler keeps it
            faulthandler.register(sig, file=self._stacks, all_threads=True, chain=False)
            self._dump_sig = sig
            _DUMPERS.append(self)
        except (OSError, RuntimeError, ValueError):
            self._stacks = None

    def close(self) -> None:
        if self._dump_sig is not None:
            sig, self._dump_sig = self._dump_sig, None
            holder = _DUMPERS[-1] if _DUMPERS else None
            if self in _DUMPERS:
                _DUMPERS.remove(self)
            others = [b._stacks for b in _DUMPERS if b._dump_sig == sig and b._stacks is not None]
            try:
                if holder is self and others:
                    faulthandler.register(sig, file=others[-1], all_threads=True, chain=False)
                elif holder is self or not others:
                    faulthandler.unregister(sig)
            except (RuntimeError, ValueError):
                pass
        try:
            os.close(self.fd)
        except OSError:
            pass


_DUMPERS: list[Beat] = []  # the Beats that registered a stack dump, in order (the last one holds it)


def dump_signal_from_env() -> signal.Signals | None:
    value = os.environ.get(ENV_DUMP_SIGNAL, "")
    try:
        return signal.Signals[value] if value else None
    except KeyError:
        return None


def beat_from_env(rank: int) -> Beat | None:
    """The rank's writer when a launcher asked for heartbeats ($SLURMRESUME_HEARTBEAT_DIR), else
    None (a bare run costs nothing). Registers the stack dump on the launcher's dump signal."""
    directory = os.environ.get(ENV_HEARTBEAT_DIR)
    if not directory:
        return None
    if not os.path.isdir(directory):  # e.g. a container with a private /dev/shm
        import logging

        logging.getLogger("slurmresume").warning(
            "no heartbeats: rank %d cannot see the launcher's directory %s; the hang watch shows it as unknown "
            "and never kills it", rank, directory)
        return None
    try:
        beat = Beat(Path(directory), rank)
    except Exception as exc:  # noqa: BLE001 - the watch is an aid; it must never stop training
        import logging

        logging.getLogger("slurmresume").warning("no heartbeats (the hang watch cannot see rank %d): %s", rank, exc)
        return None
    sig = dump_signal_from_env()
    if sig is not None:
        beat.register_dumps(Path(directory), sig)
    return beat


@contextlib.contextmanager
def phase(beat: Beat | None, name: str, *, measured_save: bool = False, budget_s: float = 0.0) -> Iterator[None]:
    """A save, restore or busy stretch of the training thread, as the hang watch sees it (a
    no-op when run bare, `beat` None). `budget_s`: a busy stretch's own budget (0: the default)."""
    global _ACTIVE
    began = beat.enter(name, budget_s) if beat is not None else 0.0
    outer, _ACTIVE = _ACTIVE, beat if beat is not None else _ACTIVE
    try:
        yield
    finally:
        _ACTIVE = outer
        if beat is not None:
            beat.leave(began, measured_save=measured_save)


_ACTIVE: Beat | None = None  # the Beat of the phase the training thread is in (phase()), for expect_io


def expect_io(kind: str, nbytes: int, logged_rate: float = 0.0) -> None:
    """Inside a save or restore (phase()): `nbytes` are to be moved now (`kind`: save, restore,
    pull); the rank's heartbeat publishes them (Beat.expect). A no-op when run bare."""
    if _ACTIVE is not None:
        _ACTIVE.expect(kind, nbytes, logged_rate)

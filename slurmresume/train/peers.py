"""This node's ranks watching each other for the failure-time save (train/failsave.py): each rank's
pid record, a thread blocked on pidfds of the others (a death is seen when it happens, with no
polling), and the small files survivors agree through. All in the launcher's node-local directory;
nothing here talks to another process."""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable
from pathlib import Path

from ..contract import FAILSAVE_DEAD_PREFIX, read_json, write_json
from ..identity import start_ticks
from .survivors import Status


def publish_pid(directory: Path, rank: int) -> None:
    """Every rank, once: its pid and the pid's start time (a reused pid is not the rank)."""
    write_json(directory / f"pid-{rank}.json", {"pid": os.getpid(), "start": start_ticks(os.getpid())})


def mark_done(directory: Path, rank: int) -> None:
    """A rank that ends normally (its Checkpointer closed): its exit is no death."""
    write_json(directory / f"done-{rank}.json", {"pid": os.getpid()})


def write_status(directory: Path, status: Status) -> None:
    write_json(directory / f"status-{status.rank}.json", {"boundary": status.boundary, "clean": status.clean})


class Watcher(threading.Thread):
    """Blocks on pidfds of this node's other ranks; a peer that exits without `done` is a death.
    Several nodes: also on the launcher's FIFO (`notice`, job/deathboard.py), readable once another
    node posted a death; `remote()` then names the dead (an empty set: nothing to act on)."""

    def __init__(self, directory: Path, peers: dict[int, int], on_death: Callable[[set[int]], None],
                 notice: int | None = None, remote: Callable[[], set[int]] = set) -> None:
        super().__init__(name="slurmresume-failsave", daemon=True)
        self.dir, self.fds, self.on_death = directory, peers, on_death  # rank -> pidfd (-1: already gone)
        self.notice, self.remote = notice, remote
        self._wake_r, self._wake_w = os.pipe()

    def dead_now(self) -> set[int]:
        out = set()
        for rank, fd in self.fds.items():
            gone = fd < 0 or bool(select.select([fd], [], [], 0)[0])
            if gone and not (self.dir / f"done-{rank}.json").exists():
                out.add(rank)
        return out

    def run(self) -> None:
        while True:
            dead = self.dead_now()
            if dead:
                self.on_death(dead)
                return
            alive = [fd for fd in self.fds.values() if fd >= 0]
            notice = [self.notice] if self.notice is not None else []
            ready = select.select([*alive, *notice, self._wake_r], [], [])[0]
            if self._wake_r in ready:
                return
            if self.notice is not None and self.notice in ready:
                dead = self.remote()
                if dead:
                    self.on_death(dead)
                    return
                self.notice = None  # a notice that names nobody (a stale file): back to the pidfds
            for rank, fd in list(self.fds.items()):
                if fd in ready and (self.dir / f"done-{rank}.json").exists():
                    os.close(fd)
                    del self.fds[rank]  # ended normally

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")


def peers(directory: Path, ranks: range, me: int) -> dict[int, int] | None:
    """rank -> pidfd of every other rank of this node (`ranks`) once each has published its pid
    (None before)."""
    out: dict[int, int] = {}
    for rank in ranks:
        if rank == me:
            continue
        rec = read_json(directory / f"pid-{rank}.json")
        if rec is None:
            for fd in out.values():
                if fd >= 0:
                    os.close(fd)
            return None
        try:
            fd = os.pidfd_open(int(rec["pid"]))
        except OSError:
            fd = -1
        if fd >= 0 and start_ticks(int(rec["pid"])) != rec.get("start"):
            os.close(fd)
            fd = -1  # the pid is another process now: the rank is gone
        out[rank] = fd
    return out


def posted_dead(directory: Path) -> set[int]:
    """The ranks some node posted as dead in the shared directory (job/deathboard.py)."""
    out = set()
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if name.startswith(FAILSAVE_DEAD_PREFIX) and name.endswith(".json"):
                with contextlib.suppress(ValueError):
                    out.add(int(name[len(FAILSAVE_DEAD_PREFIX):-5]))
    return out


def post_dead(directory: Path, ranks: set[int], by: int) -> None:
    for rank in sorted(ranks):
        write_json(directory / f"{FAILSAVE_DEAD_PREFIX}{rank}.json", {"rank": rank, "by": by})


def read_status(directory: Path, rank: int) -> Status | None:
    rec = read_json(directory / f"status-{rank}.json")
    if rec is None:
        return None
    return Status(rank, rec.get("boundary"), bool(rec.get("clean")))

"""Several nodes: each rank's snapshots also copied to the run's shared directory, in the background,
so that the ranks of a node lost whole (its launcher and ranks gone, nothing left to copy them out
at the death: train/failsave.py) are still covered by the survivors' failure save.

One thread per rank; `offer` hands it the newest bytes of a slot and returns at once (the
training thread never waits on the shared file system). The thread writes the newest bytes of each
slot (older offers of the same slot are dropped), to a temporary name then renamed, so a reader
sees a whole copy or the previous one (`stepsnap.read` checks each copy's checksum as it checks
the original). The window that remains: a node lost in the milliseconds between its ranks'
`ckpt.step(s)` and their copy of `s` landing; the survivors then lack `s` for those ranks and the
failure save is refused (the newest committed step stands), never mixed.

Cost: one small file write per rank and step on the shared file system, off the training thread
(the bytes of `snap-R-*`: the per-rank RNG, sampler, plain values and small per-rank tensors)."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path


class Copier(threading.Thread):
    def __init__(self, directory: Path, rank: int) -> None:
        super().__init__(name="slurmresume-snapcopy", daemon=True)
        self.dir, self.rank = directory, rank
        self._pending: dict[str, list[bytes]] = {}
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self.start()

    def offer(self, slot: str, data: list[bytes]) -> None:
        """The record `stepsnap.record` made for the node-local slot (its parts are bytes: never
        changed after)."""
        with self._cond:
            self._pending[slot] = data
            self._cond.notify()

    def sink(self, slot: str) -> _SlotSink:
        """This slot as one more sink of the rank's snapshot publisher (train/snappub.py)."""
        return _SlotSink(self, slot)

    def drain(self, timeout: float = 5.0) -> bool:
        """Until every offered copy is written (or `timeout`); True when none is left."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._busy, timeout)

    def stop(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if self._closed:
                    return
                slot, data = self._pending.popitem()
                self._busy = True
            try:
                path = self.dir / f"snap-{self.rank}-{slot}"
                tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
                with contextlib.suppress(OSError):
                    with tmp.open("wb") as f:
                        f.writelines(data)
                    os.replace(tmp, path)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


class _SlotSink:
    def __init__(self, copier: Copier, slot: str) -> None:
        self.copier, self.slot = copier, slot

    def write(self, parts: list[bytes]) -> None:
        self.copier.offer(self.slot, parts)

    def close(self) -> None:
        pass

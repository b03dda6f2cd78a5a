"""Several nodes: how one node's ranks learn that a rank on another node died without warning, for
the failure-time save (train/failsave.py; DESIGN.md section 10).

A node's ranks see their own peers die (pidfds, train/peers.py), never another node's. So the
survivors of the node where a rank died post `dead-<rank>.json` in the run's shared directory
(`<root>/.runs/failsave/<run id>/`, on the checkpoint root every node mounts, passed to the ranks
as $SLURMRESUME_FAILSAVE_SHARED), and that is also where all survivors then meet (statuses, the
snapshots they copy out, the writers' decisions and reports). Each node's launcher lists that
directory every SCAN_S while its torchrun runs; on the first notice it writes one byte into a
FIFO in its node-local failsave directory, which every rank of the node waits on beside its
peers' pidfds (readable: a death elsewhere). A FIFO whose bytes nobody reads stays readable for
every reader, so one write reaches all ranks.

A whole node lost (its launcher and ranks gone) has no survivor to post anything. So the launchers
also hold TCP connections in a ring (each to the next node, `launcher-<node>.json` in the shared
directory says where it listens) and tell each other their ranks as their hang watch learns them
(`ranks`). A connection that ends without the peer's `bye` is the peer launcher's death: its
kernel closed the socket (a process killed, or a launcher gone with its node; a host that vanishes
without closing is Slurm's NODE_FAIL). The launcher that sees it posts that node's ranks as dead,
wakes its own ranks, and the run's result names the lost node (`lost`): its ranks cannot come
back in this allocation, so the job is requeued (job/decision.py).

Cost on the shared file system: one directory listing per node every SCAN_S (nothing per rank,
nothing per step). Positive evidence only (DESIGN.md section 8): a notice is posted by a node that
saw the rank's process exit, or a launcher whose peer's connection was closed without a goodbye;
nothing here infers a death from silence.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import socket
import time
from pathlib import Path

from ..contract import (
    ENV_FAILSAVE_SHARED,
    FAILSAVE_DEAD_PREFIX,
    FAILSAVE_NOTICE,
    FAILSAVE_SUBDIR,
    RUNS_DIR,
    write_json,
)

SCAN_S = 0.5  # how often a launcher lists the shared directory while its run lasts
CONNECT_S = 2.0  # a ring peer's connect timeout (it listens before it posts where)
KEEP_S = 300.0  # another run's shared directory untouched for this long is removed (its survivors are long gone)


def shared_dir(root: Path, run_id: str) -> Path:
    return Path(root) / RUNS_DIR / FAILSAVE_SUBDIR / run_id


class DeathBoard:
    """One run, one node: the shared directory (made here), this node's FIFO, and (with `node` and
    `nodes`) its place in the launchers' ring."""

    def __init__(self, root: Path, run_id: str, local_dir: Path, node: int = 0, nodes: int = 1) -> None:
        self.dir = shared_dir(root, run_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node, self.nodes = node, nodes
        self.lost: set[int] = set()  # nodes whose launcher is gone
        self.ranks: dict[int, list[int]] = {}  # node -> its ranks, as its launcher said
        self._mine: list[int] = []
        self._peers: dict[socket.socket, _Peer] = {}
        self._out: socket.socket | None = None  # to the next node
        self._listen: socket.socket | None = None
        if nodes > 1:
            self._listen = socket.create_server(("", 0), backlog=8)
            self._listen.setblocking(False)
            write_json(self.dir / f"launcher-{node}.json", {"node": node, "host": socket.gethostname(),
                                                            "port": self._listen.getsockname()[1]})
        failsave = local_dir / FAILSAVE_SUBDIR
        failsave.mkdir(mode=0o700, exist_ok=True)
        path = failsave / FAILSAVE_NOTICE
        os.mkfifo(path, 0o600)
        # read-write: opening never blocks, and the FIFO always has a writer (this launcher)
        self._fd: int | None = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        self._next = 0.0
        self.noticed = False

    def env(self) -> dict[str, str]:
        return {ENV_FAILSAVE_SHARED: str(self.dir)}

    def poll(self, now: float, ranks: list[int] | None = None) -> bool:
        """Every call: the ring (connect, accept, read; a peer lost posts its ranks as dead).
        At most every SCAN_S: a death posted by any node? The first one wakes this node's ranks.
        `ranks`: this node's ranks as its hang watch knows them (told to the ring peers)."""
        if self.nodes > 1:
            self._ring(now, ranks)
        if self.noticed or now < self._next:
            return self.noticed
        self._next = now + SCAN_S
        try:
            names = os.listdir(self.dir)
        except OSError:
            return False
        if any(n.startswith(FAILSAVE_DEAD_PREFIX) and n.endswith(".json") for n in names):
            self._wake()
        return self.noticed

    def _wake(self) -> None:
        self.noticed = True
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._fd, b"!")

    # -- the launchers' ring ------------------------------------------------------------------------

    def _ring(self, now: float, ranks: list[int] | None) -> None:
        if self._out is None and now >= self._next:
            self._connect((self.node + 1) % self.nodes)
        if self._listen is not None:
            with contextlib.suppress(BlockingIOError, InterruptedError):
                while True:
                    conn, _ = self._listen.accept()
                    conn.setblocking(False)
                    self._peers[conn] = _Peer(None)
                    self._send(conn, f"ranks {self.node} {','.join(map(str, self._mine))}")
        if ranks and sorted(ranks) != self._mine:
            self._mine = sorted(ranks)
            for conn in list(self._peers):
                self._send(conn, f"ranks {self.node} {','.join(map(str, self._mine))}")
        if self._peers:
            readable = select.select(list(self._peers), [], [], 0)[0]
            for conn in readable:
                self._read(conn)

    def _connect(self, node: int) -> None:
        try:
            where = json.loads((self.dir / f"launcher-{node}.json").read_text())
            conn = socket.create_connection((where["host"], int(where["port"])), timeout=CONNECT_S)
        except (OSError, ValueError, KeyError, TypeError):
            return  # not up yet: the next scan tries again
        conn.setblocking(False)
        self._out = conn
        self._peers[conn] = _Peer(node)
        self._send(conn, f"ranks {self.node} {','.join(map(str, self._mine))}")

    def _send(self, conn: socket.socket, line: str) -> None:
        with contextlib.suppress(OSError):
            conn.sendall((line + "\n").encode())

    def _read(self, conn: socket.socket) -> None:
        peer = self._peers[conn]
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if data:
            peer.buffer += data
            *lines, peer.buffer = peer.buffer.split(b"\n")
            for line in lines:
                peer.hear(line.decode(errors="replace"), self.ranks)
            return
        del self._peers[conn]
        conn.close()
        if conn is self._out:
            self._out = None
        if peer.node is not None and not peer.bye and peer.node not in self.lost:
            self._lose(peer.node)

    def _lose(self, node: int) -> None:
        """`node`'s launcher closed its connection without a goodbye: its ranks are dead."""
        self.lost.add(node)
        dead = self.ranks.get(node, [])
        for rank in dead:
            write_json(self.dir / f"{FAILSAVE_DEAD_PREFIX}{rank}.json", {"rank": rank, "by": f"launcher {self.node}",
                                                                         "node": node})
        if dead:
            self._wake()

    def close(self) -> None:
        """The run ended here: a goodbye to the ring (this launcher is not lost), then close."""
        for conn in list(self._peers):
            self._send(conn, f"bye {self.node}")
            conn.close()
        self._peers.clear()
        if self._listen is not None:
            self._listen.close()
            self._listen = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class _Peer:
    """One ring connection: which node (known from its first line), what it said so far."""

    def __init__(self, node: int | None) -> None:
        self.node, self.bye, self.buffer = node, False, b""

    def hear(self, line: str, ranks: dict[int, list[int]]) -> None:
        word, _, rest = line.partition(" ")
        node_s, _, args = rest.partition(" ")
        try:
            node = int(node_s)
        except ValueError:
            return
        self.node = node if self.node is None else self.node
        if word == "bye":
            self.bye = True
        elif word == "ranks" and args:
            with contextlib.suppress(ValueError):
                ranks[node] = [int(r) for r in args.split(",")]


def sweep(root: Path, keep: str, now: float | None = None) -> list[str]:
    """The first node, at each run's start: remove other runs' shared directories that nothing has
    touched for KEEP_S (a straggling survivor of the previous run may still be writing in its own)."""
    base = Path(root) / RUNS_DIR / FAILSAVE_SUBDIR
    now = time.time() if now is None else now
    gone: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return gone
    for entry in entries:
        if entry.name == keep or not entry.is_dir(follow_symlinks=False):
            continue
        try:
            newest = max([entry.stat().st_mtime, *(e.stat().st_mtime for e in os.scandir(entry.path))])
        except OSError:
            continue
        if now - newest > KEEP_S:
            shutil.rmtree(entry.path, ignore_errors=True)
            gone.append(entry.name)
    return gone

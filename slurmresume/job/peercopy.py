"""One peer copy of each node's memory snapshot (issue #49 item 2): the launchers stream their
node's newest committed memory snapshot to the next node of a ring, in the background, and each
keeps the copy it received, verified, in its own memory root.

Why: a node lost whole takes its memory root with it. With sharded state (FSDP2, no replica)
its ranks' shards are then nowhere, and the failure save has to be refused. A copy on the next
node (Gemini's idea, SOSP 2023) is what the survivors can write in its place (item 4), and what a
restart restores from when the node's own copy is gone.

Who does what (every node's launcher, `PeerCopy`, two threads):
  - sender: the step the ranks pinned as the target (peerpin.py: the same step on every
    node, read from this node's pin file every WAKE_S, sent once it committed here; without a pin
    file, the newest committed step of this node's memory root) not yet sent goes to node (node + 1) % nodes,
    whose address its receiver posted in the run's shared directory (`peercopy-<node>.json`, as
    the death board's ring does). One connection per snapshot: a header line (the step, this
    node, each file's relative path and size, the commit marker last), then the bytes (sendfile),
    paced to at most `rate` bytes/s (`pause`, pure), so the copy never takes more of the node's
    memory bandwidth or NIC than its budget; a slower receiver slows the sender by TCP's own flow
    control, never the training (the ranks do not wait for it). A snapshot pruned while it is
    sent: its files were opened before the first byte went, so the copy is of one step, whole.
  - receiver: one sender at a time (the ring's previous node). Refused before a byte lands when
    the names are not plain relative paths inside one step directory or the copy would not fit
    the memory root's file system with HEADROOM to spare (one warning). The bytes go to a private
    `.saving.` directory of `peers/n<node>/`; then it is verified (`verify_part`: the manifest
    pinned by the marker, and every file the node holds whole against its size and digest: a
    node's root holds its own ranks' shards) and only then renamed into place, so a replica is either complete and verified or
    absent (never a partial one with a name). The older replicas of that node are then removed,
    but the steps the ranks pinned (the target and the step kept for a promotion): at most three
    per node exist (those two and the one arriving). A transfer cut short or a byte
    flipped on the way: that copy is dropped (one warning naming why), the next snapshot is sent.
  - the receiver answers "ok" or "refused <why>" on the same connection, so the sender knows
    what the peer verified (`sent`) and logs a refusal; it writes that answer to its node's ack
    file (`peerpin.ACKED`), the ranks' evidence for which step every node can be promoted from. `status` shows each node's replicas from
    the files (job/memroot.py `view`): a replica's lag is its node's newest snapshot minus its step.

Wire format, per snapshot: 8 bytes (big-endian length), the header's JSON, each file's bytes in the
header's order; then the receiver's one line.

Positive evidence only (DESIGN.md section 8): a replica is used only after its own verification,
and again on use (a restore verifies every byte it reads).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ..checkpoint.fsio import free_space
from ..checkpoint.layout import MARKER, SAVING_PREFIX, step_dir_name, step_dirs
from ..checkpoint.manifest import read_manifest
from ..checkpoint.shardread import hash_file, split_locator
from ..checkpoint.store import newest_committed, remove_private_step
from ..contract import ENV_PEER_COPY_MBS, write_json
from ..errors import CheckpointError
from ..peerpin import PIN, committed_here, read_pins, write_acked
from .memroot import PEERS  # under a memory root: peers/n<node>/<step dir>, that node's replica

log = logging.getLogger("slurmresume")

ENV_RATE = ENV_PEER_COPY_MBS  # the sender's cap, MB/s ("0": no peer copy)
DEFAULT_RATE_MBS = 400.0
POLL_S = 0.5  # the receiver's accept timeout (how soon `close` stops it)
WAKE_S = 0.02  # the sender's look at its node's pin file: a new target goes within this of being named
CHUNK = 8 << 20
HEADROOM = 256 << 20  # bytes left free on the memory root's file system after a replica lands
MAGIC = "slurmresume-peercopy-1"
MAX_HEADER = 64 << 20
_NAME = re.compile(r"[A-Za-z0-9_.@-]+(/[A-Za-z0-9_.@-]+)*")


def rate_from_env() -> float | None:
    """Bytes/s from $SLURMRESUME_PEER_COPY_MBS (default DEFAULT_RATE_MBS); None: "0", no peer copy.
    A value that is not a number is the default, with one warning."""
    raw = os.environ.get(ENV_RATE, "").strip()
    if not raw:
        return DEFAULT_RATE_MBS * 1e6
    try:
        mbs = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of MB/s: using %g", ENV_RATE, raw, DEFAULT_RATE_MBS)
        return DEFAULT_RATE_MBS * 1e6
    return mbs * 1e6 if mbs > 0 else None


def pause(sent: int, elapsed: float, rate: float) -> float:
    """Pure: seconds to wait before sending more, so that `sent` bytes took at least sent / rate."""
    return max(0.0, sent / rate - elapsed)


def replica_root(memory: Path, node: int) -> Path:
    """Where this node keeps its copy of `node`'s snapshots (a checkpoint root of its own)."""
    return memory / PEERS / f"n{node}"


def listing(step_dir: Path) -> list[tuple[str, int]]:
    """Every regular file of a committed step directory, relative, with its size, the commit marker
    last (the receiver writes it last too). Raises OSError if the directory went away."""
    found: list[tuple[str, int]] = []
    for dirpath, dirnames, filenames in os.walk(step_dir):
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(dirpath) / name
            st = path.lstat()
            rel = path.relative_to(step_dir).as_posix()
            if rel != MARKER and path.is_file() and not path.is_symlink():
                found.append((rel, st.st_size))
    found.append((MARKER, (step_dir / MARKER).lstat().st_size))
    return found


def verify_part(path: Path, step: int) -> str | None:
    """The receiver: a copy of one node's part of a committed step (on several nodes a node's root
    holds its own ranks' shards, train/memtier.py): its manifest, pinned by its marker, and every
    file the manifest lists that the copy holds, whole against its recorded size and digest; at
    least one shard. None, or why not."""
    try:
        manifest = read_manifest(path, expected_step=step)
        shards = {s["file"] for s in manifest.shards}
        present = [f for f in manifest.files if os.path.lexists(path / split_locator(f["file"])[0])]
        if not any(f["file"] in shards for f in present):
            return "it holds no shard of the step"
        for f in present:
            digest = hash_file(path, f["file"], f["bytes"])
            if digest != f["xxh3"]:
                return f"{f['file']} fails its checksum (xxh3 {digest}, manifest {f['xxh3']})"
    except CheckpointError as exc:
        return str(exc)
    return None


def header_problem(header: Any, free: int | None) -> str | None:
    """Pure, the receiver: why a transfer's header is refused before any byte lands, or None."""
    if not isinstance(header, dict) or header.get("magic") != MAGIC:
        return "not a peer copy"
    step, node, files = header.get("step"), header.get("node"), header.get("files")
    if not isinstance(step, int) or step < 0 or not isinstance(node, int) or node < 0:
        return "no step or node"
    if not isinstance(files, list) or not files:
        return "no files"
    total = 0
    for entry in files:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or not isinstance(entry[1], int) or entry[1] < 0):
            return "a malformed file entry"
        name = entry[0]
        if not _NAME.fullmatch(name) or any(part in (".", "..") for part in name.split("/")):
            return f"a file name that is not a plain relative path: {name!r}"
        total += entry[1]
    if files[-1][0] != MARKER:
        return "the commit marker is not the last file"
    if free is not None and total + HEADROOM > free:
        return f"it would not fit: {total} bytes, {free} free on the memory root's file system"
    return None


class PeerCopy:
    """One node's launcher: the sender and the receiver threads of the peer copy of one run."""

    def __init__(self, memory: Path, shared: Path, node: int, nodes: int, rate: float) -> None:
        self.memory, self.shared, self.node, self.nodes, self.rate = memory, shared, node, nodes, rate
        self.target = (node + 1) % nodes
        self.sent: int | None = None  # the newest step the peer said it verified
        self.tried: int | None = None  # the newest step sent (a refused one is not sent again)
        self.refused: str | None = None  # the peer's last refusal
        self._stop = threading.Event()
        self._listen = socket.create_server(("", 0), backlog=2)
        self._listen.settimeout(POLL_S)
        self._threads = [threading.Thread(target=self._send_loop, name="peercopy-send", daemon=True),
                         threading.Thread(target=self._receive_loop, name="peercopy-receive", daemon=True)]

    def start(self) -> PeerCopy:
        where = {"node": self.node, "host": socket.gethostname(), "port": self._listen.getsockname()[1]}
        write_json(self.shared / f"peercopy-{self.node}.json", where)
        for t in self._threads:
            t.start()
        return self

    def close(self) -> None:
        """The run ended on this node: both threads stop (a transfer in flight is cut; the
        receiving side drops it). The replicas stay with the memory root (job/memroot.py frees it)."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._listen.close()

    # -- sender -------------------------------------------------------------------------------------

    def _send_loop(self) -> None:
        while not self._stop.wait(WAKE_S):
            step = self._due()
            if step is None or (self.tried is not None and step <= self.tried):
                continue
            if not committed_here(self.memory, step):
                continue  # the target is the snapshot being written: sent once it committed here
            try:
                self._send(step)
            except OSError as exc:  # the peer not up yet, gone, or the step pruned: tried again after POLL_S
                log.debug("peer copy of step %d to node %d: %s", step, self.target, exc)
                self._stop.wait(POLL_S)

    def _send(self, step: int) -> None:
        src = self.memory / step_dir_name(step)
        files = listing(src)
        handles = [open(src / rel, "rb") for rel, _ in files]  # noqa: SIM115 - all open before a byte goes
        try:
            where = json.loads((self.shared / f"peercopy-{self.target}.json").read_text())
            with socket.create_connection((where["host"], int(where["port"])), timeout=30) as conn:
                header = json.dumps({"magic": MAGIC, "node": self.node, "step": step,
                                     "files": [[r, s] for r, s in files]}).encode()
                try:
                    conn.sendall(len(header).to_bytes(8, "big") + header)
                    began, sent = time.monotonic(), 0
                    for (_, size), f in zip(files, handles):
                        offset = 0
                        while offset < size:
                            if self._stop.is_set():
                                return
                            time.sleep(pause(sent, time.monotonic() - began, self.rate))
                            n = conn.sendfile(f, offset, min(CHUNK, size - offset))
                            if n == 0:
                                raise OSError(f"{f.name} shrank while it was sent")
                            offset, sent = offset + n, sent + n
                    answer = _readline(conn)
                except OSError as exc:
                    # the peer was up and closed on us (a header it refused answers before the
                    # body, so the body breaks): this step is that peer's to refuse, not to be sent
                    # again at every look; the next target is
                    answer = f"refused the connection broke during the copy ({exc})"
        except (ValueError, KeyError, TypeError) as exc:
            raise OSError(f"no address for node {self.target}'s peer copy: {exc}") from None
        finally:
            for f in handles:
                f.close()
        self.tried = step
        if answer == "ok":
            self.sent, self.refused = step, None
        else:  # not sent again: the next snapshot is
            self.refused = answer.removeprefix("refused ") or "the connection closed"
            log.warning("peer copy of step %d to node %d refused: %s", step, self.target, self.refused)
        # the ranks' evidence that the peer holds this step verified (peerpin.py)
        write_acked(self.memory, self.sent, None if answer == "ok" else step)

    def _due(self) -> int | None:
        """The step to send: the ranks' target (peerpin.py); without a pin file (ranks that
        do not pin), the newest committed snapshot."""
        pinned = read_pins(self.memory)
        return pinned.target if (self.memory / PIN).exists() else _newest(self.memory)

    # -- receiver -----------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listen.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(60)
                try:
                    self._receive(conn)
                except OSError as exc:
                    log.warning("peer copy received on node %d dropped: %s", self.node, exc)

    def _receive(self, conn: socket.socket) -> None:
        try:
            size = int.from_bytes(_exactly(conn, 8), "big")
            header = json.loads(_exactly(conn, size)) if size <= MAX_HEADER else None
        except (ValueError, _Bad):
            header = None
        base = self.memory / PEERS
        with contextlib.suppress(OSError):
            base.mkdir(exist_ok=True)
        why = header_problem(header, _free(base))
        if why is not None:
            log.warning("peer copy refused on node %d: %s", self.node, why)
            _answer(conn, f"refused {why}")
            return
        assert isinstance(header, dict)
        step, node = header["step"], header["node"]
        root = replica_root(self.memory, node)
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f"{SAVING_PREFIX}{step_dir_name(step)}.{uuid.uuid4().hex[:16]}"
        tmp.mkdir()
        try:
            for rel, size in header["files"]:
                path = tmp / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                _receive_file(conn, path, size)
            problem = verify_part(tmp, step)
            if problem is not None:
                raise _Bad(f"step {step} of node {node} failed its check: {problem}")
            final = root / step_dir_name(step)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp, final)
        except _Bad as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("peer copy dropped on node %d: %s", self.node, exc)
            _answer(conn, f"refused {exc}")
            return
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        keep = read_pins(self.memory).held()  # the same steps on every node (peerpin.py)
        for s, path in step_dirs(root):
            if s < step and s not in keep:
                remove_private_step(path)
        _answer(conn, "ok")


class _Bad(Exception):
    pass


def _receive_file(conn: socket.socket, path: Path, size: int) -> None:
    buf = bytearray(min(CHUNK, max(size, 1)))
    view = memoryview(buf)
    left = size
    with open(path, "wb") as f:
        while left:
            n = conn.recv_into(view, min(len(buf), left))
            if n == 0:
                raise _Bad(f"the transfer ended {left} bytes short of {path.name}")
            f.write(view[:n])
            left -= n


def _exactly(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = conn.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise _Bad("the transfer ended inside its header")
        data += chunk
    return bytes(data)


def _readline(conn: socket.socket) -> str:
    """The receiver's one-line answer (short); "" when the connection closed without one."""
    data = bytearray()
    while not data.endswith(b"\n") and len(data) < 4096:
        chunk = conn.recv(4096)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _answer(conn: socket.socket, line: str) -> None:
    with contextlib.suppress(OSError):
        conn.sendall((line + "\n").encode())


def _newest(memory: Path) -> int | None:
    try:
        return newest_committed(memory)
    except OSError:
        return None


def _free(path: Path) -> int | None:
    free = free_space(path)[0]
    return free if free >= 0 else None





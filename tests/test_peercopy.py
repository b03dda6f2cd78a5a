"""Issue 49 item 2: each node's memory snapshot copied to the next node by the launchers, in the
background, verified on arrival (job/peercopy.py). Two launchers' PeerCopy here, each with its
own memory root, over real loopback sockets, with real checkpoints (Checkpointer.save)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.core import model_equal, restore_fresh, save_steps, shard, tiny_model

from slurmresume.checkpoint.layout import MARKER, step_dir_name, step_dirs
from slurmresume.job import memroot, peercopy
from slurmresume.job.peercopy import MAGIC, PeerCopy, header_problem, pause, replica_root

# -- the pure parts ----------------------------------------------------------------------------------


def test_pause_keeps_the_rate_and_never_waits_when_behind() -> None:
    assert pause(100_000_000, 0.0, 100e6) == pytest.approx(1.0)
    assert pause(100_000_000, 0.25, 100e6) == pytest.approx(0.75)
    assert pause(100_000_000, 3.0, 100e6) == 0.0
    assert pause(0, 0.0, 1.0) == 0.0


def _header(files: list[list[Any]], **over: Any) -> dict[str, Any]:
    return {"magic": MAGIC, "node": 0, "step": 4, "files": files, **over}


@pytest.mark.parametrize(("header", "free", "why"), [
    (_header([["a.safetensors", 10], [MARKER, 5]]), None, None),
    (_header([["sub/a.bin", 10], [MARKER, 5]]), 10 << 30, None),
    (_header([["../escape", 10], [MARKER, 5]]), None, "plain relative path"),
    (_header([["/etc/passwd", 10], [MARKER, 5]]), None, "plain relative path"),
    (_header([["a/../../b", 10], [MARKER, 5]]), None, "plain relative path"),
    (_header([[MARKER, 5], ["a.safetensors", 10]]), None, "marker is not the last"),
    (_header([["a", -1], [MARKER, 5]]), None, "malformed"),
    (_header([]), None, "no files"),
    (_header([["a", 1 << 30], [MARKER, 5]]), 1 << 30, "would not fit"),
    (_header([["a", 1], [MARKER, 5]], magic="other"), None, "not a peer copy"),
    (_header([["a", 1], [MARKER, 5]], step="4"), None, "no step"),
    ("not a dict", None, "not a peer copy"),
])
def test_a_header_is_refused_before_any_byte_lands(header: Any, free: int | None, why: str | None) -> None:
    got = header_problem(header, free)
    assert (got is None) if why is None else (got is not None and why in got), got


# -- two launchers, real sockets and checkpoints ------------------------------------------------------


def _wait(predicate: Any, what: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout  # a hang guard only: the assertions are on files
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def ring(tmp_path: Path) -> Any:
    shared = tmp_path / "shared"
    shared.mkdir()
    mems = [tmp_path / "mem0", tmp_path / "mem1"]
    for m in mems:
        m.mkdir()
    copies = [PeerCopy(mems[n], shared, n, 2, rate=1e9).start() for n in range(2)]
    yield mems, copies
    for c in copies:
        c.close()


def _files(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_a_snapshot_lands_on_the_next_node_verified_and_restores_bitwise(ring: Any) -> None:
    (mem0, mem1), (c0, c1) = ring
    save_steps(mem0, [3])
    replica = replica_root(mem1, 0)
    _wait(lambda: (replica / step_dir_name(3) / MARKER).exists(), "the replica of step 3")
    assert _files(replica / step_dir_name(3)) == _files(mem0 / step_dir_name(3))
    _wait(lambda: c0.sent == 3, "the sender to hear ok")
    assert memroot.view(mem1)["replicas"] == {"0": 3}  # type: ignore[index]
    step, state = restore_fresh(replica)  # a checkpoint root of its own: restores like one, verified
    assert step == 3 and model_equal(state["model"], tiny_model(3))
    # the next snapshot replaces it: at most the newest replica (and one arriving) per node
    save_steps(mem0, [5])
    _wait(lambda: c0.sent == 5, "the replica of step 5")
    assert [s for s, _ in step_dirs(replica)] == [5]
    assert not list(replica.glob(".saving.*"))
    # the receiver's own snapshots are not confused with the replicas it holds
    assert not step_dirs(mem1)
    # what `status` shows of node 1's memory: no snapshot of its own, node 0's copy and its bytes
    shown = memroot.view(mem1)
    assert shown is not None and shown["step"] is None and shown["replicas"] == {"0": 5}, shown
    assert shown["bytes"] == sum(p.stat().st_size for p in (replica / step_dir_name(5)).iterdir())


def test_a_byte_flipped_on_the_way_is_dropped_and_the_next_snapshot_lands(ring: Any, monkeypatch: Any) -> None:
    (mem0, mem1), (c0, _c1) = ring
    real = socket.socket.sendfile
    flipped: list[int] = []

    def corrupting(self: socket.socket, file: Any, offset: int = 0, count: int | None = None) -> int:
        if not flipped and file.name.endswith(".safetensors"):
            file.seek(offset)
            data = bytearray(file.read(count))
            data[-1] ^= 0x01
            flipped.append(len(data))
            self.sendall(bytes(data))
            return len(data)
        return real(self, file, offset, count)

    monkeypatch.setattr(socket.socket, "sendfile", corrupting)
    save_steps(mem0, [3])
    _wait(lambda: c0.tried == 3, "the first transfer")
    assert flipped and c0.sent is None and c0.refused and "failed its check" in c0.refused
    replica = replica_root(mem1, 0)
    assert not step_dirs(replica) and not list(replica.glob(".saving.*"))
    monkeypatch.setattr(socket.socket, "sendfile", real)
    save_steps(mem0, [4])
    _wait(lambda: c0.sent == 4, "the next snapshot")
    assert [s for s, _ in step_dirs(replica)] == [4]
    step, state = restore_fresh(replica)
    assert step == 4 and model_equal(state["model"], tiny_model(4))


def _raw_transfer(shared: Path, node: int, header: dict[str, Any], body: bytes) -> str:
    where = json.loads((shared / f"peercopy-{node}.json").read_text())
    with socket.create_connection((where["host"], where["port"]), timeout=30) as conn:
        data = json.dumps(header).encode()
        with contextlib.suppress(OSError):  # a refusal may close the connection before the body is read
            conn.sendall(len(data).to_bytes(8, "big") + data + body)
            conn.shutdown(socket.SHUT_WR)
        try:
            return conn.makefile("rb").read().decode()
        except OSError:  # reset: the receiver closed with our bytes unread
            return ""


def test_a_transfer_cut_short_leaves_nothing_and_a_bad_name_writes_nothing(ring: Any) -> None:
    (mem0, mem1), _ = ring
    save_steps(mem0, [2])
    src = mem0 / step_dir_name(2)
    whole = shard(mem0, 2).read_bytes()
    files = [[shard(mem0, 2).relative_to(src).as_posix(), len(whole)], [MARKER, 10]]
    answer = _raw_transfer(mem1.parent / "shared", 1, _header(files, node=7, step=9), whole[: len(whole) // 2])
    assert "refused" in answer or answer == ""
    assert not step_dirs(replica_root(mem1, 7)) and not list(replica_root(mem1, 7).glob(".saving.*"))
    answer = _raw_transfer(mem1.parent / "shared", 1, _header([["../../evil", 3], [MARKER, 1]], node=8), b"")
    assert "plain relative path" in answer
    assert not (mem1 / "evil").exists() and not (mem1.parent / "evil").exists()
    assert not replica_root(mem1, 8).exists()


def test_the_rate_comes_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.delenv(peercopy.ENV_RATE, raising=False)
    assert peercopy.rate_from_env() == peercopy.DEFAULT_RATE_MBS * 1e6
    monkeypatch.setenv(peercopy.ENV_RATE, "0")
    assert peercopy.rate_from_env() is None
    monkeypatch.setenv(peercopy.ENV_RATE, "50")
    assert peercopy.rate_from_env() == 50e6


def test_the_sender_sends_the_pinned_target_and_its_ack_is_the_ranks_evidence(ring: Any) -> None:
    """The ranks name the step to copy (peerpin.py's pin file); the sender sends that one,
    not its newest, and writes the receiver's "ok" to its node's ack file; the receiver keeps the
    pinned steps' replicas when a newer one lands."""
    from slurmresume.peerpin import Pins, read_acked, write_pins

    (mem0, mem1), (c0, _c1) = ring
    for m in (mem0, mem1):
        write_pins(m, Pins(3, None))
    save_steps(mem0, [3, 4])  # 4 is newer, but 3 is the target
    replica = replica_root(mem1, 0)
    _wait(lambda: read_acked(mem0) == (3, None), "the ack of step 3")
    assert [s for s, _ in step_dirs(replica)] == [3] and c0.sent == 3
    # every node acked 3: it is kept; 5 is the next target
    save_steps(mem0, [5])
    for m in (mem0, mem1):
        write_pins(m, Pins(5, 3))
    _wait(lambda: read_acked(mem0) == (5, None), "the ack of step 5")
    assert sorted(s for s, _ in step_dirs(replica)) == [3, 5]  # the promotable step survives the newer replica
    # then 7 acked and 5 kept: 3 is freed
    save_steps(mem0, [7])
    for m in (mem0, mem1):
        write_pins(m, Pins(7, 5))
    _wait(lambda: read_acked(mem0) == (7, None), "the ack of step 7")
    assert sorted(s for s, _ in step_dirs(replica)) == [5, 7]


def test_a_refused_target_is_written_as_refused_for_the_ranks(ring: Any, monkeypatch: Any) -> None:
    from slurmresume.peerpin import Pins, read_acked, write_pins

    (mem0, mem1), _copies = ring
    real = socket.socket.sendfile

    def corrupting(self: socket.socket, file: Any, offset: int = 0, count: int | None = None) -> int:
        if not file.name.endswith(".safetensors"):
            return real(self, file, offset, count)
        file.seek(offset)
        data = bytearray(file.read(count))
        data[-1] ^= 0x01  # the receiver's check fails: it answers "refused"
        self.sendall(bytes(data))
        return len(data)

    monkeypatch.setattr(socket.socket, "sendfile", corrupting)
    for m in (mem0, mem1):
        write_pins(m, Pins(3, None))
    save_steps(mem0, [3])
    _wait(lambda: read_acked(mem0) == (None, 3), "the refusal")
    assert not step_dirs(replica_root(mem1, 0))


def test_a_copy_refused_on_its_header_is_not_sent_again_in_a_loop(ring: Any, monkeypatch: Any) -> None:
    """A receiver that refuses a snapshot on its header (it would not fit) answers and closes
    before the body: the sender's sendfile then breaks (the body is larger than the socket's
    buffers). That is the peer's refusal, not a peer that is not up yet: written as refused for
    the ranks, and not sent again (before: re-sent at every look, 50 times a second)."""
    from slurmresume.peerpin import Pins, read_acked, write_pins

    (mem0, mem1), _copies = ring
    seen: list[str | None] = []
    real = peercopy.header_problem

    def no_room(header: Any, free: int | None) -> str | None:
        seen.append(real(header, 0))
        return seen[-1]

    monkeypatch.setattr(peercopy, "header_problem", no_room)
    for m in (mem0, mem1):
        write_pins(m, Pins(3, None))
    save_steps(mem0, [3])
    (mem0 / step_dir_name(3) / "big.bin").write_bytes(bytes(64 << 20))  # past any socket buffer
    _wait(lambda: read_acked(mem0) == (None, 3), "the refusal written for the ranks")
    time.sleep(1.0)  # 50 looks of the sender: none may send step 3 again
    assert len(seen) == 1 and seen[0] and "fit" in seen[0], seen
    assert not step_dirs(replica_root(mem1, 0))

"""Issue 47's per-step snapshot, off the training thread: the training thread only grabs (copies,
RNG states), one publisher thread per rank digests, encodes and writes (train/snappub.py), and the
failure-save protocol keeps its guarantees: a survivor's status only once its own snapshots are on
disk, nothing published after it, `tail_changed` exact even when writes are coalesced, and a slot
that lags (a rank killed before its write landed) is refused or covered exactly, never mixed."""

from __future__ import annotations

import math
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import slurmresume
from slurmresume.checkpoint.jsonenc import encode
from slurmresume.checkpoint.state import flatten
from slurmresume.train import failsave, rng, stepsnap
from slurmresume.train.snappub import FileSink, Publisher
from slurmresume.train.survivors import plan

HANG_GUARD_S = 60.0  # only a hang guard: nothing here depends on how fast the box is


# -- the training thread's part: the same bytes as before, fewer of them ---------------------------


class _Stateful:
    def state_dict(self) -> dict:
        return {"n": 1}

    def load_state_dict(self, d: dict) -> None:
        pass


@pytest.mark.parametrize("obj", [
    {"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1, 2], "foreach": None, "amsgrad": False, "name": "adam"},
    [1, -2, 1 << 70, True, 0.0, -0.0, 1e308, float("nan"), float("inf"), -math.inf],
    {"__tuple__": 1}, {1: "a", "b": 2}, {"a": {"__float__": "x", "y": 1}},
    [np.float32(1.5), np.int64(3), np.arange(3), b"raw", bytearray(b"x")],
    {"t": torch.arange(3.0), "nested": [{"u": torch.zeros(2)}, (torch.ones(1),)]},
    [[], {}, (), [1, 2.0], [True, 1]],
    {"s": "caf\u00e9 \"q\"\n", "x" * 100: "y" * 100, "n": None, "f": [5e-324, -1e-7, 1e22, 2 ** 53 + 1]},
])
def test_the_fast_encoder_encodes_exactly_as_jsonenc(obj: Any) -> None:
    """The training thread's encoder (`stepsnap._fast_text`) gives the JSON text of
    `jsonenc.encode`'s output, and names each tensor by the same path."""
    seen_fast: list[list[str]] = []
    seen_slow: list[list[str]] = []
    fast = stepsnap._fast_text(obj, lambda p, t: seen_fast.append(p) or "/".join(p), (None, "key"))
    slow = encode(obj, lambda p, t: seen_slow.append(p) or "/".join(p), ["key"])
    assert fast == stepsnap.dumps(slow) and seen_fast == seen_slow


def _np_equal(a: Any, b: Any) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and tuple(a[2:]) == tuple(b[2:])


def test_the_rng_capturer_equals_a_full_capture_and_takes_numpy_once_while_it_is_unchanged() -> None:
    """`rng.Capturer` against `rng.capture` after each kind of move of NumPy's legacy state: draws,
    a Gaussian pair (one cached), the cached Gaussian used (key and position unchanged), a seed, a
    set_state; and while nothing moved, the same state object (NumPy's get_state not called)."""
    saved = rng.capture()
    try:
        cap = rng.Capturer()
        moves = [lambda: None, lambda: np.random.rand(3), lambda: np.random.randn(1), lambda: np.random.randn(1),
                 lambda: np.random.seed(7), lambda: None, lambda: np.random.set_state(np.random.get_state()),
                 lambda: np.random.randn(1), lambda: random.random(), lambda: torch.rand(2)]
        previous = None
        for move in moves:
            move()
            got, full = cap.capture(), rng.capture()
            assert _np_equal(got["numpy"], full["numpy"])
            assert got["python"] == full["python"] and torch.equal(got["torch_cpu"], full["torch_cpu"])
            if previous is not None and _np_equal(previous, full["numpy"]) and not previous[3]:
                assert got["numpy"] is previous  # unchanged: taken once
            previous = got["numpy"]
        np.random.randn(1)
        if not np.random.get_state()[3]:
            np.random.randn(1)  # now a cached Gaussian (has_gauss 1): each capture reads NumPy again
        first = cap.capture()["numpy"]
        assert first[3] == 1 and cap.capture()["numpy"] is not first
    finally:
        rng.restore(saved)


def test_the_raw_rng_capture_gives_the_bytes_of_a_full_capture() -> None:
    """`rng.Capturer.raw` (Python's generator read through its object, NumPy's taken once while
    unchanged, torch's as bytes) against `rng.as_raw(rng.capture())` after each kind of move: draws,
    a Gaussian of Python's (its cached `gauss_next`), seeds, NumPy's cached Gaussian used, torch."""
    saved = rng.capture()
    try:
        cap = rng.Capturer()
        assert cap._py_address  # CPython's layout: the view is used (else the test below tests getstate)
        moves = [lambda: None, lambda: random.random(), lambda: random.gauss(0, 1), lambda: random.gauss(0, 1),
                 lambda: random.seed(3), lambda: random.setstate(random.getstate()), lambda: np.random.rand(3),
                 lambda: np.random.randn(1), lambda: np.random.randn(1), lambda: np.random.seed(7),
                 lambda: torch.rand(2), lambda: torch.manual_seed(5), lambda: [random.random() for _ in range(700)]]
        for move in moves:
            move()
            assert cap.raw() == rng.as_raw(rng.capture())
    finally:
        rng.restore(saved)


def _optimizer_text_general(opt: Any) -> str:
    value = {k: v for k, v in opt.state_dict().items() if k != "state"}
    return stepsnap.dumps({"kind": "stateful", "value": encode(value, lambda p, t: "/".join(p), ["optimizer"])})


def test_an_optimizers_kept_text_is_the_general_paths_at_every_step() -> None:
    """The optimizer's entry kept between captures (`stepsnap._OptimizerText`: a value that is the
    same immutable object keeps its JSON) is, at every capture, what the general path gives: lr
    moved by a scheduler, a value replaced, a tensor lr changed in place, a list changed in place, a
    key added, a parameter group added (one whose "params" is not its first key); a state_dict hook turns it off for good (the general path)."""
    state = _train_state(2)
    opt, model = state["optimizer"], state["model"]
    _, tensors = flatten(state, {})
    layout = stepsnap.Layout.learn(state, {n for n, _ in tensors})
    assert set(layout.texts) == {"optimizer"}
    extra, extra2 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)

    def check() -> None:
        g = stepsnap.grab(1, state, layout, None, None, None)
        assert (type(g.entries["optimizer"]) is stepsnap._Json) == ("optimizer" in layout.texts)
        assert stepsnap.finish(g).texts["optimizer"] == _optimizer_text_general(opt)

    moves = [lambda: None, lambda: state["scheduler"].step(), lambda: state["scheduler"].step(),
             lambda: opt.param_groups[0].__setitem__("weight_decay", 0.5),
             lambda: opt.param_groups[0].__setitem__("weight_decay", 1),  # an int now: "1", not "1.0"
             lambda: opt.param_groups[0].__setitem__("weight_decay", True),
             lambda: opt.param_groups[0].__setitem__("weight_decay", -0.0),
             lambda: opt.param_groups[0].__setitem__("lr", torch.tensor(0.01)),
             lambda: opt.param_groups[0]["lr"].fill_(0.02),  # the same tensor, changed in place
             lambda: opt.param_groups[0].__setitem__("betas", [0.9, 0.99]),
             lambda: opt.param_groups[0]["betas"].__setitem__(1, 0.98),  # the same list, changed in place
             lambda: opt.param_groups[0].__setitem__("extra", (1, 2.5, None)),
             lambda: opt.add_param_group({"params": list(extra.parameters()), "lr": 0.3}),
             lambda: opt.param_groups[1].__setitem__("lr", float("inf")),
             # a group whose "params" is not its first key: values before and after it move
             lambda: opt.add_param_group({"lr": 0.4, "weight_decay": 0.0, "params": list(extra2.parameters())}),
             lambda: opt.param_groups[2].__setitem__("lr", 0.41),
             lambda: opt.param_groups[2].__setitem__("weight_decay", 0.125),
             lambda: opt.param_groups[2].__setitem__("eps", 1e-6),
             lambda: model.zero_grad(),
             lambda: opt.register_state_dict_post_hook(lambda o, sd: sd)]
    for move in moves:
        move()
        check()
    assert "optimizer" not in layout.texts  # the hook: the general path from then on


# -- the publisher ----------------------------------------------------------------------------------


class Gate:
    """A sink in front of another: passes, holds every write until opened, or drops it (a rank
    killed before its write landed: `dropped` keeps what would have been written)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.open, self.drop = inner, threading.Event(), False
        self.open.set()
        self.written: list[bytes] = []
        self.dropped: list[bytes] = []
        self.entered = threading.Event()

    def write(self, parts: list[bytes]) -> None:
        self.entered.set()
        assert self.open.wait(HANG_GUARD_S)
        if self.drop:
            self.dropped.append(b"".join(parts))
            return
        self.inner.write(parts)
        self.written.append(b"".join(parts))

    def close(self) -> None:
        self.inner.close()


def _record(step: int) -> list[bytes]:
    return [f"record {step}".encode()]


def test_the_publisher_prepares_every_job_in_order_and_writes_the_newest_of_each_slot(tmp_path: Path) -> None:
    gates = {s: Gate(FileSink(tmp_path / s)) for s in ("a", "b")}
    pub = Publisher({s: [g] for s, g in gates.items()})
    prepared: list[int] = []

    def job(step: int) -> Any:
        def prepare() -> Any:
            prepared.append(step)
            return lambda: _record(step)
        return prepare

    gates["a"].open.clear()
    pub.submit("a", job(1))
    assert gates["a"].entered.wait(HANG_GUARD_S)  # the thread is held inside the write of 1
    for step in range(2, 8):  # it falls behind: a and b queue up
        pub.submit("a" if step % 2 else "b", job(step))
    gates["a"].open.set()
    assert pub.drain(HANG_GUARD_S)
    assert prepared == list(range(1, 8))  # every job prepared, in order
    assert gates["a"].written == [b"record 1", b"record 7"]  # 3 and 5: coalesced, the newest won
    assert gates["b"].written == [b"record 6"]
    assert _written(tmp_path / "a") == b"record 7" and _written(tmp_path / "b") == b"record 6"
    pub.close()


def test_a_stopped_publisher_writes_nothing_more_and_a_failing_one_stops(tmp_path: Path) -> None:
    gate = Gate(FileSink(tmp_path / "a"))
    pub = Publisher({"a": [gate]})
    pub.submit("a", lambda: lambda: _record(1))
    assert pub.drain(HANG_GUARD_S)
    pub.stop()
    assert not pub.submit("a", lambda: lambda: _record(2))  # stopped: refused, nothing more is written
    assert gate.written == [b"record 1"] and _written(tmp_path / "a") == b"record 1"
    pub.close()

    def broken() -> Any:
        raise OSError("no space left on device")

    pub = Publisher({"a": [Gate(FileSink(tmp_path / "b"))]})
    pub.submit("a", broken)
    assert not pub.drain(HANG_GUARD_S) and pub.failed is not None and "no space" in pub.failed
    assert not pub.submit("a", lambda: lambda: _record(3)) and not _written(tmp_path / "b")
    pub.close()


def _written(path: Path) -> bytes:
    """A slot file's record: a slot is a fixed-size mapped file (`FileSink`), zeros after the record."""
    return path.read_bytes().rstrip(b"\0")


def test_a_slot_holds_each_record_whole_mapped_or_not_and_a_longer_one_left_behind_is_cut(tmp_path: Path) -> None:
    """`FileSink` copies a record of up to MAP_BYTES into its mapping, a longer one by pwritev; a
    reader (`stepsnap.read`) gets each record exactly, also a short one written over a long one."""
    from slurmresume.train import snappub

    sink = FileSink(tmp_path / "s")
    assert sink._map is not None
    state = _train_state(3)
    layout = stepsnap.Layout.learn(state, set())
    small = stepsnap.capture(5, state, layout, None, {"loss": 1.5}, None)
    big = stepsnap.record(stepsnap.Grab(6, {}, {"t": ("uint8", [snappub.MAP_BYTES], b"x" * snappub.MAP_BYTES)}, [],
                                        rng.Capturer().raw(), None, "null", "null"))
    for parts, step in ((small, 5), (big, 6), (small, 5)):
        sink.write(parts)
        snap = stepsnap.read(tmp_path / "s")
        assert snap is not None and snap["step"] == step
        assert stepsnap.cut((tmp_path / "s").read_bytes()) == b"".join(parts)  # what a copy elsewhere takes
    assert (tmp_path / "s").stat().st_size > snappub.MAP_BYTES  # the long record went past the mapping
    sink.close()


def test_a_slot_that_cannot_be_mapped_is_written_by_pwritev_with_one_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A node-local file system too full to allocate the mapped bytes: one warning, and every record is
    still written (by pwritev), never a SIGBUS later on a page the file system could not give."""
    import errno
    import os

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with caplog.at_level("WARNING", logger="slurmresume"):
        sink = FileSink(tmp_path / "s")
    assert sink._map is None and "written by pwritev" in caplog.text and "No space left" in caplog.text
    sink.write([b"record ", b"9"])
    assert (tmp_path / "s").read_bytes() == b"record 9"
    sink.close()


def test_an_inline_publisher_has_written_when_submit_returns(tmp_path: Path) -> None:
    pub = Publisher({"0": [FileSink(tmp_path / "x")]}, background=False)
    assert pub.submit("0", lambda: lambda: _record(1)) and _written(tmp_path / "x") == b"record 1"
    pub.stop()
    assert not pub.submit("0", lambda: lambda: _record(2)) and _written(tmp_path / "x") == b"record 1"
    pub.close()


def test_every_sink_of_a_slot_gets_the_record(tmp_path: Path) -> None:
    """A slot's record goes to each of its sinks (the node-local file, and later a copy elsewhere)."""
    pub = Publisher({"0": [FileSink(tmp_path / "x"), FileSink(tmp_path / "y")]})
    pub.submit("0", lambda: lambda: _record(4))
    assert pub.drain(HANG_GUARD_S)
    assert _written(tmp_path / "x") == _written(tmp_path / "y") == b"record 4"
    pub.close()


# -- the guard, in process (no launcher: the collective of the first step is skipped) ---------------


def _train_state(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    sampler = slurmresume.ResumableSampler(list(range(64)), shuffle=True, seed=1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # the optimizer's state exists (as at any ckpt.step() but before the first step)
    sched.step()
    return {"model": model, "optimizer": opt, "scheduler": sched, "sampler": sampler, "loss": 0.0}


def _guard(tmp_path: Path, rank: int, state: dict[str, Any], world: int = 2) -> failsave.FailureGuard:
    guard = failsave.FailureGuard(tmp_path / "hb", tmp_path / "root", rank, world)
    _, tensors = flatten(state, {})
    guard._layout = stepsnap.Layout.learn(state, {n for n, _ in tensors}, world)  # as DDP: all replicated
    for slot, sinks in guard._pub.sinks.items():
        guard._pub.sinks[slot] = [Gate(s) for s in sinks]
    return guard


def _gate(guard: failsave.FailureGuard, slot: str) -> Gate:
    gate = guard._pub.sinks[slot][0]
    assert isinstance(gate, Gate)
    return gate


def _forward_backward(state: dict[str, Any]) -> None:
    loss = state["model"](torch.randn(3, 4)).pow(2).mean()  # dropout: the RNG moves
    state["optimizer"].zero_grad()
    loss.backward()
    state["loss"] = loss.item()  # before the optimizer step (as examples/train.py)


def _after_optimizer(state: dict[str, Any]) -> None:
    state["scheduler"].step()
    state["sampler"].advance(4)


@pytest.fixture
def guards(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[failsave.FailureGuard]]:
    monkeypatch.setattr(failsave, "peers", lambda *a: None)  # no watcher: nobody dies here
    monkeypatch.setattr(failsave, "PUBLISH_IN_BACKGROUND", True)  # the thread: its ordering is what is tested
    made: list[failsave.FailureGuard] = []
    yield made
    for g in made:
        for sinks in g._pub.sinks.values():
            for s in sinks:
                if isinstance(s, Gate):
                    s.open.set()
        g._hook.remove()
        g._pub.close(HANG_GUARD_S)


def _snap(path: Path) -> dict[str, Any]:
    snap = stepsnap.read(path)
    assert snap is not None
    return snap


def test_a_survivor_reports_its_status_only_once_its_snapshot_is_on_disk(
        tmp_path: Path, guards: list[failsave.FailureGuard]) -> None:
    state = _train_state(1)
    guard = _guard(tmp_path, 0, state)
    guards.append(guard)
    guard.at_step(1, state, {"loss": 0.0}, None, None, {})
    assert guard._pub.drain(HANG_GUARD_S)
    gate = _gate(guard, "tail")
    gate.open.clear()  # the publisher is slow: held in the tail's write, step 2's boundary queued behind it
    _forward_backward(state)
    state["optimizer"].step()
    _after_optimizer(state)
    guard.at_step(2, state, {"loss": 1.0}, None, None, {})
    guard._frozen.set()  # a peer died
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(guard._finish_step()))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not out  # no status while step 2's snapshot is not on disk
    gate.open.set()
    t.join(HANG_GUARD_S)
    assert out and out[0].boundary == 2 and out[0].clean
    assert _snap(tmp_path / "hb" / "snap-0-0")["step"] == 2
    # reported: nothing more is published (a late job is not written)
    before = {s: (tmp_path / "hb" / f"snap-0-{s}").read_bytes() for s in failsave.SLOTS}
    assert not guard._pub.submit("1", lambda: lambda: [b"late"])
    assert {s: (tmp_path / "hb" / f"snap-0-{s}").read_bytes() for s in failsave.SLOTS} == before


def test_a_dirty_survivor_reports_only_once_its_tail_is_on_disk(
        tmp_path: Path, guards: list[failsave.FailureGuard], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failsave, "FINISH_WAIT_S", 0.0)  # it will not reach its ckpt.step()
    state = _train_state(1)
    guard = _guard(tmp_path, 0, state)
    guards.append(guard)
    gate = _gate(guard, "1")
    gate.open.clear()  # the publisher is slow: held in boundary 3's write, the tail queued behind it
    guard.at_step(3, state, {"loss": 0.0}, None, None, {})
    _forward_backward(state)
    state["optimizer"].step()  # the pre-hook: the tail snapshot
    guard._frozen.set()
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(guard._finish_step()))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not out
    gate.open.set()
    t.join(HANG_GUARD_S)
    assert out and out[0].boundary == 3 and not out[0].clean
    tail = _snap(tmp_path / "hb" / "snap-0-tail")
    assert tail["tail_of"] == 3


def _run(state: dict[str, Any], guard: failsave.FailureGuard, step: int, *, draw_after: bool = False) -> None:
    _forward_backward(state)
    state["optimizer"].step()
    _after_optimizer(state)
    if draw_after:
        torch.rand(1)  # a random number drawn after the optimizer step: the RNG changed after the tail
    guard.at_step(step, state, {"loss": state["loss"]}, None, None, {})


@pytest.mark.parametrize("behind", [False, True])
def test_tail_changed_is_exact_also_when_writes_are_coalesced(
        tmp_path: Path, guards: list[failsave.FailureGuard], behind: bool) -> None:
    """Every tail is compared with the boundary after it, in order: the pieces an optimizer step
    changes (optimizer, scheduler, sampler; not the loss, set before it), and the RNG once a step
    drew after its optimizer step; also when the publisher fell behind and those steps' records
    were never written (coalesced)."""
    state = _train_state(1)
    guard = _guard(tmp_path, 0, state)
    guards.append(guard)
    guard.at_step(1, state, {"loss": 0.0}, None, None, {})
    assert guard._pub.drain(HANG_GUARD_S)
    gate = _gate(guard, "0")
    if behind:
        gate.open.clear()  # held inside the write of step 2: steps 3-7 queue up
    for step in range(2, 8):
        _run(state, guard, step, draw_after=step == 4)
        if step == 2 and behind:
            assert gate.entered.wait(HANG_GUARD_S)
    gate.open.set()
    assert guard._pub.drain(HANG_GUARD_S)
    expect = {"entry:optimizer", "entry:scheduler", "entry:sampler", "rng"}
    got = _snap(tmp_path / "hb" / "snap-0-1")  # step 7
    assert got["step"] == 7 and set(got["tail_changed"]) == expect
    tail = _snap(tmp_path / "hb" / "snap-0-tail")
    # which pieces the tail leaves out (those known to change) is learned on the publisher's thread:
    # a tail grabbed before it caught up carries them too (a larger record, never a wrong one), so
    # only the step is asserted here; tail_changed above is the exact part (CI 2026-12-07, loaded)
    assert tail["tail_of"] == 6
    if behind:  # boundary 4 and the tail before it (the RNG's change) were never written: compared all the same
        assert [_read(w)["step"] for w in gate.written] == [2, 6]
        assert [_read(w)["tail_of"] for w in _gate(guard, "tail").written] == [1, 6]


def _read(data: bytes) -> dict[str, Any]:
    out = stepsnap.read_bytes(data)
    assert out is not None
    return out


@pytest.mark.parametrize("lost", ["boundary", "boundary and tail"])
def test_a_rank_killed_before_its_snapshot_landed_is_refused_or_covered_exactly_never_mixed(
        tmp_path: Path, guards: list[failsave.FailureGuard], lost: str) -> None:
    """Two ranks; rank 1 is killed after its boundary 5 was captured and before the write landed
    (its boundary slot lags: it holds 3), and, in the second case, before its tail after 4 landed
    too (the tail slot holds the tail after 3). Rank 0 is clean at 5. The plan over what is on
    disk either covers rank 1 by its tail, and the rebuilt rank 1 is exactly its own boundary 5
    (the record that never landed), or refuses step 5: never a mixed step."""
    states = [_train_state(1), _train_state(1)]
    gs = [_guard(tmp_path, r, states[r]) for r in (0, 1)]
    guards.extend(gs)
    for g, st in zip(gs, states, strict=True):
        g.at_step(1, st, {"loss": 0.0}, None, None, {})
    for step in range(2, 6):
        for st in states:
            _forward_backward(st)
        if step == 5:  # rank 1 dies with writes in flight: they never land
            for g in gs:
                assert g._pub.drain(HANG_GUARD_S)
            _gate(gs[1], "1").drop = True  # boundary 5 (slot 1)
            if lost == "boundary and tail":
                _gate(gs[1], "tail").drop = True  # the tail after 4
        for st in states:
            st["optimizer"].step()  # both guards' pre-hooks: each rank's tail, once
            _after_optimizer(st)
        for g, st in zip(gs, states, strict=True):
            g.at_step(step, st, {"loss": st["loss"]}, None, None, {})
    gs[0]._frozen.set()
    status = gs[0]._finish_step()
    assert gs[1]._pub.drain(HANG_GUARD_S)
    assert status.boundary == 5 and status.clean
    hb = tmp_path / "hb"
    assert _snap(hb / "snap-1-1")["step"] == 3  # the lagging slot
    snaps = {r: failsave._snapshots(hb, r) for r in (0, 1)}
    got = plan(2, {1}, {0: status}, snaps)
    if lost == "boundary and tail":
        assert not got.ok and "rank 1's RNG and plain values at step 5" in " | ".join(got.refused), got.refused
        return
    assert got.ok and got.step == 5 and dict(got.spliced).get(1)
    spliced = stepsnap.splice(_snap(hb / "snap-1-tail"), _snap(hb / "snap-0-1"), dict(got.spliced)[1])
    own = stepsnap.read_bytes(_gate(gs[1], "1").dropped[-1])  # what rank 1 would have published at 5
    assert own is not None and own["step"] == 5
    skeleton, _ = flatten(states[1], {})
    got_skeleton, got_tensors = stepsnap.rebuild(spliced, skeleton)
    expect_skeleton, expect_tensors = stepsnap.rebuild(own, skeleton)
    assert got_skeleton == expect_skeleton
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got_tensors, expect_tensors, strict=True))

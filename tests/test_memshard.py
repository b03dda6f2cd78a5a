"""Issue 49: a dead FSDP2 rank's pieces from its memory-tier snapshot of exactly the failure save's
step (train/memshard.py): taken only from the directory this run's own snapshot of that step wrote,
every byte checked against the digests written with it; a torn or flipped shard, another step's or
another incarnation's snapshot is refused, and the plan never mixes steps. Real shards written by
the save's own `write_rank` into real directories on tmp_path."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slurmresume.checkpoint.collective import Group
from slurmresume.checkpoint.commit import prepare, write_rank
from slurmresume.checkpoint.layout import MARKER, shard_name, step_dir_name
from slurmresume.train.memshard import Kept, Refused, pieces
from slurmresume.train.survivors import Plan, Snapshot, Status, plan

WORLD = 4


def _snapshot(root: Path, step: int, seed: int = 0) -> tuple[str, dict[str, torch.Tensor]]:
    """Rank 3's shard of `step` in a fresh private directory of `root`, as the memory tier writes it."""
    g = torch.Generator().manual_seed(seed)
    tensors = {"model/0.weight": torch.randn(64, 32, generator=g), "optimizer/state/0/exp_avg": torch.randn(64, 32,
                                                                                                          generator=g)}
    decision = prepare(root, step)
    assert decision.action == "write"
    report = write_rank(root, step, Group(rank=3, world_size=WORLD), {"entries": {}}, sorted(tensors.items()),
                        into=decision.dir)
    assert report.error is None, report.error
    return decision.dir, tensors


def test_the_dead_ranks_pieces_come_from_this_runs_snapshot_of_the_step(tmp_path: Path) -> None:
    into, tensors = _snapshot(tmp_path, 7)
    got = pieces(tmp_path, 7, Kept(into), 3, WORLD)
    assert set(got) == set(tensors) and all(torch.equal(got[n], t) for n, t in tensors.items())
    # committed since: this node's step_7 carries the marker this run's save sent
    (tmp_path / into / MARKER).write_bytes(b"marker of this run")
    (tmp_path / into).rename(tmp_path / step_dir_name(7))
    got = pieces(tmp_path, 7, Kept(into, committed=True, marker=b"marker of this run"), 3, WORLD)
    assert all(torch.equal(got[n], t) for n, t in tensors.items())


def _flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "says"), [
    (lambda f: f.write_bytes(f.read_bytes()[:-100]), "outside the file"),  # torn: cut short
    (lambda f: _flip(f, f.stat().st_size - 5), "fails its checksum"),  # a flipped byte in a tensor
    (lambda f: f.unlink(), "missing"),  # the dead rank died before its shard landed
    (lambda f: (f.parent / "rank-00003.index.json").unlink(), "missing"),  # no digests: nothing to verify with
])
def test_a_torn_or_flipped_memory_shard_is_refused(tmp_path: Path, damage, says: str) -> None:  # noqa: ANN001
    into, _ = _snapshot(tmp_path, 7)
    damage(tmp_path / into / shard_name(3, WORLD))
    with pytest.raises(Refused, match=says):
        pieces(tmp_path, 7, Kept(into), 3, WORLD)


def test_another_steps_or_another_runs_snapshot_is_refused(tmp_path: Path) -> None:
    """Never mixed: the snapshot must be of exactly the step, and this run's own."""
    six, _ = _snapshot(tmp_path, 6)
    with pytest.raises(Refused, match="not a snapshot directory of step 7"):  # the step before
        pieces(tmp_path, 7, Kept(six), 3, WORLD)
    with pytest.raises(Refused, match="took no memory snapshot of step 7"):  # this run has none of step 7
        pieces(tmp_path, 7, None, 3, WORLD)
    # an earlier incarnation's step 7, committed on this node, and this run's own save of 7 gone
    old, _ = _snapshot(tmp_path, 7, seed=1)
    (tmp_path / old / MARKER).write_bytes(b"an earlier incarnation's marker")
    (tmp_path / old).rename(tmp_path / step_dir_name(7))
    mine = ".saving.step_000000007.0123456789abcdef"
    with pytest.raises(Refused, match="no snapshot of step 7 of this run"):
        pieces(tmp_path, 7, Kept(mine), 3, WORLD)
    with pytest.raises(Refused, match="another marker"):
        pieces(tmp_path, 7, Kept(mine, committed=True, marker=b"this run's marker"), 3, WORLD)


PIECES = ("model/0.weight", "optimizer/state/0/exp_avg")


def test_plan_takes_a_dead_fsdp_ranks_pieces_only_from_its_snapshot_of_that_step() -> None:
    """FSDP2, rank 1 dead, survivors clean at 7: rank 0 (its node's survivor) offers rank 1's
    snapshot of 7 and writes that shard; an offer of step 6, or by a survivor not clean at 7, is
    no cover (refused as before)."""
    snaps = {r: [Snapshot(r, s, PIECES) for s in (6, 7)] for r in range(WORLD)}
    clean = {r: Status(r, 7, True) for r in (0, 2, 3)}
    fsdp = {n: ((4,), (False,)) for n in PIECES}
    got = plan(WORLD, {1}, clean, snaps, replicas=fsdp, memory={1: (7, 2)})
    assert got == Plan(7, 0, shards=((1, 2), (2, 2), (3, 3)), from_snapshot=(1,))
    for memory, statuses in (({1: (6, 2)}, clean), ({1: (7, 2)}, {**clean, 2: Status(2, 7, False)}),
                             ({}, clean)):
        got = plan(WORLD, {1}, statuses, snaps, replicas=fsdp, memory=memory)
        assert not got.ok and "rank 1's per-rank tensors" in " | ".join(got.refused), got


def test_the_optimizer_step_after_a_snapshot_waits_for_it_and_a_broken_one_for_the_freeze(tmp_path: Path) -> None:
    """The one-step bound (train/memtier.py): a rank's optimizer step after `ckpt.step(7)` waits
    until its snapshot of 7 has ended; one whose collective broke (a peer died) holds it until the
    failure guard freezes the rank, so that no survivor leaves the boundary it holds."""
    import threading

    from slurmresume.train.memtier import MemoryTier

    tier = MemoryTier(tmp_path, 1, Group(rank=0, world_size=WORLD), None, tmp_path)  # type: ignore[arg-type]
    frozen = threading.Event()

    def waiter(step: int) -> threading.Thread:
        t = threading.Thread(target=tier.wait_ended, args=(step, frozen.is_set), daemon=True)
        t.start()
        return t

    tier._started = 7  # the snapshot of step 7 is being written
    t = waiter(7)
    t.join(0.3)
    assert t.is_alive()  # still waiting: the snapshot has not ended
    tier._save = lambda *a: None  # type: ignore[method-assign]  # it ends: committed
    tier._write(7, None, 0.0)  # type: ignore[arg-type]
    t.join(30)  # a hang guard only
    assert not t.is_alive()

    def broken(*a: object) -> None:
        raise RuntimeError("Connection closed by peer")

    tier._started = 8
    tier._save = broken  # type: ignore[method-assign]
    t = waiter(8)
    with pytest.raises(RuntimeError):
        tier._write(8, None, 0.0)  # type: ignore[arg-type]
    t.join(0.3)
    assert t.is_alive()  # a broken snapshot: the optimizer step waits for the freeze ...
    frozen.set()
    t.join(30)
    assert not t.is_alive()  # ... which the failure guard's pre-hook then blocks on for good


class _Tier:
    """A memory tier that records the failure guard's waits (the wait itself: the test above)."""

    def __init__(self) -> None:
        self.waits: list[int] = []

    def wait_ended(self, step: int, stop: object) -> None:
        self.waits.append(step)


@pytest.mark.parametrize("replicated", [True, False], ids=["ddp", "sharded"])
def test_only_a_rank_with_unpublished_pieces_waits_for_its_memory_snapshot(tmp_path: Path, replicated: bool,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait before the optimizer step is the price of the FSDP2 bound only: a DDP rank (every
    tensor replicated, its small state published) never waits for the memory tier; a rank whose
    2 MiB parameter is its own (too large to publish) waits once per boundary."""
    from slurmresume.checkpoint.state import flatten
    from slurmresume.train import failsave, stepsnap

    monkeypatch.setattr(failsave, "peers", lambda *a: None)  # no watcher: nobody dies here
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optimizer": opt}
    guard = failsave.FailureGuard(tmp_path / "hb", tmp_path / "root", 0, 2)
    try:
        _, tensors = flatten(state, {})
        guard._layout = stepsnap.Layout.learn(state, {n for n, _ in tensors} if replicated else set(), 2)
        guard.memory = tier = _Tier()
        for step in (1, 2):
            guard.at_step(step, state, None, None, None, {})
            model(torch.randn(2, 1024)).sum().backward()
            opt.step()
        assert tier.waits == ([] if replicated else [1, 2])
    finally:
        guard._hook.remove()
        guard._pub.close(5.0)

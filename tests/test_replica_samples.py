"""Replica detection reads a per-rank tensor only by samples (issue #32: the full hashing pass
before every multi-rank save was ~7% of a 2-rank x 1 GiB save), and decides exactly as before."""

from __future__ import annotations

import threading
from typing import Any

import torch
import xxhash

from slurmresume.checkpoint import replicas


class ThreadGroup:
    """`world` ranks as threads of this process, with the collectives replicas.py uses."""

    def __init__(self, rank: int, shared: dict[str, Any]) -> None:
        self.rank, self.shared, self.world_size = rank, shared, shared["world"]

    def _exchange(self, value: Any) -> list[Any]:
        s = self.shared
        s["slots"][self.rank] = value
        s["barrier"].wait()
        out = list(s["slots"])
        s["barrier"].wait()
        return out

    def max_ints(self, values: list[int]) -> list[int]:
        return [max(col) for col in zip(*self._exchange(list(values)), strict=True)]

    def all_gather_json(self, obj: Any) -> list[Any]:
        return self._exchange(obj)


def _run(states: list[list[tuple[str, torch.Tensor]]]) -> list[set[str]]:
    shared = {"world": len(states), "slots": [None] * len(states), "barrier": threading.Barrier(len(states))}
    out: list[set[str]] = [set()] * len(states)

    def rank(r: int) -> None:
        out[r] = replicas.replicated_across(ThreadGroup(r, shared), states[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(states))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_per_rank_tensors_are_read_by_samples_and_the_replicas_are_found_exactly(monkeypatch: Any) -> None:
    hashed: list[int] = []
    real_one, real_stream = xxhash.xxh3_64_hexdigest, xxhash.xxh3_64

    class Stream:
        def __init__(self) -> None:
            self.h = real_stream()

        def update(self, data: Any) -> None:
            hashed.append(len(memoryview(data).cast("B")))
            self.h.update(data)

        def hexdigest(self) -> str:
            return self.h.hexdigest()

    def one(data: Any) -> str:
        hashed.append(len(memoryview(data).cast("B")))
        return real_one(data)

    monkeypatch.setattr(replicas.xxhash, "xxh3_64_hexdigest", one)
    monkeypatch.setattr(replicas.xxhash, "xxh3_64", Stream)
    g = torch.Generator().manual_seed(0)
    big = 4 << 20  # floats: 16 MiB each
    shared_big = torch.randn(big, generator=g)
    # one byte differs in the middle, between the samples: only the full hash can tell
    nearly = [shared_big.clone() for _ in range(3)]
    nearly[2].view(torch.uint8)[big * 2 + 12345] ^= 1
    states = [[("replica", shared_big.clone()), ("per_rank", torch.randn(big, generator=g)),
               ("nearly", nearly[r]), ("small_same", torch.ones(10)), ("small_diff", torch.full((10,), float(r)))]
              for r in range(3)]
    results = _run(states)
    assert results == [{"replica", "small_same"}] * 3
    samples = 3 * 3 * replicas.SAMPLES * replicas.SAMPLE_BYTES + 3 * 2 * 40  # 3 ranks' samples of the 3 large ones
    # read in full: the replica and the near-replica on each rank (3 x 2 x 16 MiB), never the per-rank tensor
    assert sum(hashed) == 3 * 2 * big * 4 + samples, sum(hashed)


def test_a_sample_of_a_device_tensor_equals_the_host_sample() -> None:
    t = torch.randn(1 << 20)
    view = replicas.tensor_bytes(t)
    assert replicas.sample_digest(replicas._device_sample(t)) == replicas.sample_digest(view)


def _counted(states: list[list[tuple[str, torch.Tensor]]]) -> tuple[list[set[str]], list[int]]:
    """`_run`, and the int64 values each rank reduced (each all-reduce's bytes are 8 x that)."""
    sent: list[int] = [0] * len(states)
    real = ThreadGroup.max_ints

    def counting(self: ThreadGroup, values: list[int]) -> list[int]:
        sent[self.rank] += len(values)
        return real(self, values)

    ThreadGroup.max_ints = counting  # type: ignore[method-assign]
    try:
        return _run(states), sent
    finally:
        ThreadGroup.max_ints = real  # type: ignore[method-assign]


def _adam_like(rank: int, steps: int, rng_of_rank: bool = False, odd_step: int | None = None) -> list[tuple[str, Any]]:
    """An FSDP2 + Adam save's plain tensors: a 0-dim `step` per parameter, the library's RNG."""
    out = [(f"optim/state/{i}/step", torch.tensor(7.0 + (rank if i == odd_step else 0))) for i in range(steps)]
    rng = torch.Generator().manual_seed(rank if rng_of_rank else 0).get_state()
    return [*out, (f"{replicas.LIBRARY_PREFIX}rng/torch_cpu", rng)]


def test_a_save_compares_its_plain_tensors_by_a_fixed_number_of_values() -> None:
    """Issue #50: each plain tensor cost two int64s in a MAX all-reduce (16 B received per tensor
    per save: 18.4 KB at 405B's 1,135 `step` tensors). The digests fold into one per family (the
    library's own, the rest): a fixed count at any number of tensors, and exactly as decided before."""
    for steps in (10, 1000):
        results, sent = _counted([_adam_like(r, steps) for r in range(3)])
        assert results == [{n for n, _ in _adam_like(0, steps)}] * 3
        assert sent == [sent[0]] * 3 and sent[0] <= 8, (steps, sent)  # names, count and 2 folds, each +/-
    # a per-rank RNG (a run seeding each rank apart): only the library's family is compared one by one
    results, sent = _counted([_adam_like(r, 1000, rng_of_rank=True) for r in range(3)])
    assert results == [{f"optim/state/{i}/step" for i in range(1000)}] * 3
    assert sent[0] <= 8 + 2, sent
    # one tensor that differs on one rank: the rest's fold differs, then each is compared, as before
    results, _ = _counted([_adam_like(r, 50, odd_step=17) for r in range(3)])
    assert results == [{n for n, _ in _adam_like(0, 50)} - {"optim/state/17/step"}] * 3


def test_small_replicas_are_kept_in_every_shard_only_when_all_of_them_fit() -> None:
    """Issue #50: a same-W restore opened shard 0 on every rank for the replicated `step` tensors
    and RNG; they are now in every rank's shard too, all or none (a DDP model's replicated weights,
    over the budget: rank 0's shard alone, as before). DTensors are never copied."""
    small = _adam_like(0, 1135)
    names = {n for n, _ in small}
    assert replicas.everywhere(names, small, {}) == names
    big = [*small, ("model/w", torch.zeros(replicas.EVERYWHERE_BUDGET // 4))]
    assert replicas.everywhere(names | {"model/w"}, big, {}) == set()
    assert replicas.everywhere(names | {"model/w"}, big, {"model/w": {}}) == names
    assert replicas.everywhere(names - {"optim/state/3/step"}, small, {}) == names - {"optim/state/3/step"}

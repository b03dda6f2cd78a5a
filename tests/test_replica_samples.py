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

"""The download's part size (pure): chosen from the object's size, about four parts per thread,
whole MiB, within [8 MiB, 64 MiB]. (The download itself, hashed as its parts arrive, is
exercised against the real S3 server in test_mirror.py and test_mirror_network.py.)"""

from __future__ import annotations

import pytest

from slurmresume.mirror.download import MAX_PART, MIB, MIN_PART, part_size


@pytest.mark.parametrize(("size", "workers", "part"), [
    (0, 8, MIN_PART),
    (1, 8, MIN_PART),
    (256 * MIB, 8, 8 * MIB),  # 32 parts
    (1024 * MIB, 8, 32 * MIB),  # 32 parts
    (1024 * MIB + 1, 8, 33 * MIB),  # whole MiB, rounded up
    (64 * 1024 * MIB, 8, MAX_PART),  # never one huge part per thread
    (1024 * MIB, 0, MAX_PART),  # no workers given: still a valid size
])
def test_part_size_follows_the_object_size(size: int, workers: int, part: int) -> None:
    assert part_size(size, workers) == part


def test_every_part_size_is_a_whole_number_of_pages() -> None:
    assert all(part_size(n * 12345679, 8) % 4096 == 0 for n in range(1, 200))

"""The upload's plan (part size and parts in flight within a memory bound) and its pool against
the real S3 server: the bound holds, a failed part leaves no multipart upload behind."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture
from hypothesis import given
from hypothesis import strategies as st

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MARKER, step_dir_name
from slurmresume.errors import CheckpointError
from slurmresume.mirror import parse_s3_url
from slurmresume.mirror.transfer import upload_step
from slurmresume.mirror.upload import MAX_IN_FLIGHT, MIB, S3_MAX_PARTS, S3_MIN_PART, plan_upload
from slurmresume.storage import bucketsteps
from slurmresume.storage.settings import MirrorSettings

GIB = 1 << 30


@pytest.mark.parametrize(("largest", "memory", "part", "in_flight"), [
    (1 * MIB, 128 * MIB, 8 * MIB, 10),  # one PUT per file (a file up to a part is not split)
    (256 * MIB, 128 * MIB, 8 * MIB, 10),  # boto3's part size and concurrency: 80 MiB held
    (1 * GIB, 128 * MIB, 8 * MIB, 10),
    (200 * GIB, 128 * MIB, 21 * MIB, 6),  # 10,000 parts at most: larger parts, fewer in flight
    (256 * MIB, 32 * MIB, 8 * MIB, 4),  # SLURMRESUME_MIRROR_UPLOAD_MIB=32: the former 4 x 8 MiB
    (256 * MIB, 1 * MIB, 8 * MIB, 1),  # below one part: one part at a time, never none
])
def test_the_plan_follows_the_size_and_the_memory_bound(largest: int, memory: int, part: int,
                                                         in_flight: int) -> None:
    plan = plan_upload(largest, memory)
    assert (plan.part, plan.in_flight) == (part, in_flight)
    assert plan.memory == part * in_flight


def test_an_explicit_part_size_is_kept_above_s3s_minimum() -> None:
    assert plan_upload(GIB, part=5 * MIB, in_flight=3) == plan_upload(GIB, part=1 * MIB, in_flight=3)
    assert plan_upload(GIB, part=1 * MIB, in_flight=3).part == S3_MIN_PART


@given(largest=st.integers(0, 5 << 40), memory_mib=st.integers(1, 1 << 16))
def test_the_plan_stays_within_the_memory_bound_and_s3s_limits(largest: int, memory_mib: int) -> None:
    plan = plan_upload(largest, memory_mib * MIB)
    assert plan.part >= S3_MIN_PART and plan.part % MIB == 0
    assert -(-largest // plan.part) <= S3_MAX_PARTS
    assert 1 <= plan.in_flight <= MAX_IN_FLIGHT
    assert plan.memory <= max(memory_mib * MIB, plan.part)  # the bound, or one part when it is below one


class Counting:
    """A real client whose upload_part calls are counted (most at once) and can fail on the n-th."""

    def __init__(self, s3: Any, fail_at: int = 0) -> None:
        self._s3, self._lock, self.fail_at = s3, threading.Lock(), fail_at
        self.now = self.most = self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._s3, name)

    def upload_part(self, **kwargs: Any) -> Any:
        from botocore.exceptions import ClientError

        with self._lock:
            self.calls += 1
            self.now += 1
            self.most = max(self.most, self.now)
            n = self.calls
        try:
            if n == self.fail_at:
                raise ClientError({"Error": {"Code": "InternalError", "Message": "injected"}}, "UploadPart")
            return self._s3.upload_part(**kwargs)
        finally:
            with self._lock:
                self.now -= 1


def saved(root: Path) -> Path:
    ckpt = Checkpointer(root, handle_signals=False)
    ckpt.save(1, {"w": torch.randn(10 << 20, generator=torch.Generator().manual_seed(1))})  # 40 MiB: 6 parts
    ckpt.close()
    return root / step_dir_name(1)


def test_an_upload_keeps_no_more_parts_in_flight_than_its_memory_bound(s3, tmp_path: Path) -> None:
    step_dir, loc = saved(tmp_path / "root"), parse_s3_url(unique_url())
    counting = Counting(s3)
    result = upload_step(counting, loc, step_dir, 1, settings=MirrorSettings(upload_mib=16))  # 2 x 8 MiB
    assert result.action == "uploaded"
    assert counting.calls == 6 and counting.most <= 2
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 1 and info.verified


def test_a_failed_part_aborts_the_upload_and_commits_nothing(s3, tmp_path: Path) -> None:
    step_dir, loc = saved(tmp_path / "root"), parse_s3_url(unique_url())
    counting = Counting(s3, fail_at=3)
    with pytest.raises(CheckpointError, match="uploading part"):
        upload_step(counting, loc, step_dir, 1, settings=MirrorSettings(upload_mib=16))
    assert s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.key(1, MARKER)).get("KeyCount", 0) == 0
    assert not s3.list_multipart_uploads(Bucket=loc.bucket, Prefix=loc.step_prefix(1)).get("Uploads")
    # the next try commits
    assert upload_step(s3, loc, step_dir, 1).action == "uploaded"
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 1 and info.verified

"""Restore with a mirror when a tier is damaged, against the real S3 server (SeaweedFS).

- Empty local root and every committed bucket step corrupt: restore refuses (one line naming
  the bad steps) instead of training from step 0; `allow_fresh_start=True` is the explicit way.
- The newest local step corrupt while the bucket holds that same commit intact: the step is
  fetched again (verified) and loaded, instead of falling back to an older local step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.core import model_equal, tiny_state
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.errors import CheckpointError
from slurmresume.mirror import parse_s3_url
from slurmresume.storage import bucketsteps

SHARD = "rank-00000-of-00001.safetensors"


def save(root: Path, *steps: int, **kwargs) -> None:
    ckpt = Checkpointer(root, handle_signals=False, **kwargs)
    for s in steps:
        ckpt.save(s, tiny_state(s))
        if ckpt.mirror is not None:
            ckpt.mirror.wait()
    ckpt.close()


def flip_bucket_byte(s3, url: str, step: int) -> None:
    loc = parse_s3_url(url)
    key = bucketsteps.object_key(s3, loc, step, SHARD)
    body = bytearray(s3.get_object(Bucket=loc.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF  # same size: only the checksum can tell
    s3.put_object(Bucket=loc.bucket, Key=key, Body=bytes(body))


def test_empty_root_and_an_all_corrupt_mirror_refuses_a_fresh_start(s3, tmp_path: Path) -> None:
    url = unique_url()
    save(tmp_path / "a", 3, 6, mirror=url)
    for step in (3, 6):
        flip_bucket_byte(s3, url, step)
    lost = tmp_path / "lost"  # the cluster's file system is gone: the bucket is the only copy
    ckpt = Checkpointer(lost, handle_signals=False, mirror=url)
    with pytest.raises(CheckpointError, match=r"refusing a fresh start.*step_000000006.*step_000000003") as err:
        ckpt.restore(tiny_state(0))
    assert "\n" not in str(err.value)
    assert not [p for p in lost.iterdir() if p.name.startswith(("step_", ".mirror"))] if lost.exists() else True
    state = tiny_state(0)
    assert ckpt.restore(state, allow_fresh_start=True) == 0  # the explicit way to start over
    ckpt.close()
    assert model_equal(state["model"], tiny_state(0)["model"])


def test_a_corrupt_newest_local_step_is_fetched_again_from_the_mirror(s3, tmp_path: Path) -> None:
    url = unique_url()
    root = tmp_path / "root"
    save(root, 2, 5, mirror=url)
    shard = root / step_dir_name(5) / SHARD
    body = bytearray(shard.read_bytes())
    body[-1] ^= 0xFF
    shard.write_bytes(bytes(body))
    state = tiny_state(0)
    ckpt = Checkpointer(root, handle_signals=False, mirror=url)
    assert ckpt.restore(state) == 5  # not step 2: the bucket's copy of 5 is intact
    ckpt.close()
    assert model_equal(state["model"], tiny_state(5)["model"]) and state["extra"] == tiny_state(5)["extra"]
    assert bucketsteps.find_latest(s3, parse_s3_url(url), verify=True).step == 5
    ckpt = Checkpointer(root, handle_signals=False)  # the local copy itself is whole again
    assert ckpt.restore(tiny_state(0), verify=True) == 5
    ckpt.close()

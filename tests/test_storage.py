"""storage.py: one interface over a checkpoint root, a directory or a bucket, picked once by
`open_root` (issue 48, item 4). The same questions get the same answers, byte for byte, from
both tiers; a directory on a tmpfs (the memory tier) is just a directory root."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from helpers.core import save_steps, tiny_state
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MANIFEST, MARKER, step_dir_name
from slurmresume.errors import ConfigError
from slurmresume.retention import RetentionPolicy
from slurmresume.storage import BucketRoot, DirRoot, is_bucket, open_root

SHARD = "rank-00000-of-00001.safetensors"


def test_open_root_tells_a_bucket_from_a_directory_once(tmp_path: Path) -> None:
    assert isinstance(open_root("s3://bucket-a/run/1"), BucketRoot)
    assert open_root("s3://bucket-a/run/1").url == "s3://bucket-a/run/1"
    assert open_root("s3://bucket-a/run/1").directory is None
    local = open_root(tmp_path)
    assert isinstance(local, DirRoot) and local.directory == tmp_path and local.url == str(tmp_path)
    assert open_root(None, resolve=lambda p: tmp_path).directory == tmp_path
    assert not is_bucket(None) and not is_bucket("runs/s3") and is_bucket("s3://b/p")
    with pytest.raises(ConfigError, match="not a valid S3 bucket name"):
        open_root("s3://Bad_Bucket/run")


def _tier_answers(root: DirRoot | BucketRoot, step: int) -> tuple[bytes, bytes, object]:
    manifest = root.read_manifest(step)
    size = next(s["bytes"] for s in manifest.files if s["file"] == SHARD)
    return root.read_marker(step), root.open_range(step, SHARD, 8, size - 8), manifest.files


def test_a_directory_root_answers_every_question_of_the_interface(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2, 3]).close()
    root = DirRoot(tmp_path)
    assert root.steps() == [3, 2, 1]
    assert [i.step for i in root.infos()] == [3, 2, 1] and all(i.complete for i in root.infos())
    latest = root.latest()
    assert latest is not None and latest.step == 3 and latest.url == str(tmp_path / step_dir_name(3))
    marker, shard_bytes, _ = _tier_answers(root, 3)
    step_dir = tmp_path / step_dir_name(3)
    assert marker == (step_dir / MARKER).read_bytes()
    assert shard_bytes == (step_dir / SHARD).read_bytes()[8:]
    assert [r.ok for r in root.verify(every=True)] == [True, True, True]
    plan = root.plan(root.records(), RetentionPolicy(keep=2), 0.0)
    assert [r.step for r in plan.delete] == [1]
    result = root.prune(RetentionPolicy(keep=2))
    assert result.deleted == [step_dir_name(1)] and root.steps() == [3, 2]
    root.delete(2)
    assert root.steps() == [3] and not (tmp_path / step_dir_name(2)).exists()


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no tmpfs at /dev/shm")
def test_a_root_in_host_memory_is_a_directory_root() -> None:
    """The memory tier needs no third implementation: a tmpfs directory is a `DirRoot`."""
    with tempfile.TemporaryDirectory(dir="/dev/shm", prefix="slurmresume-test-") as tmp:
        save_steps(Path(tmp), [4]).close()
        root = open_root(tmp)
        assert isinstance(root, DirRoot)
        latest = root.latest(verify=True)
        assert latest is not None and latest.step == 4 and latest.verified


def test_a_bucket_root_gives_the_directory_tiers_bytes(s3, tmp_path: Path) -> None:  # noqa: F811
    """The same record and the same bytes from a bucket as from the directory it mirrors."""
    url = unique_url()
    ckpt = Checkpointer(tmp_path / "local", handle_signals=False, mirror=url)
    for s in (1, 2):
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0 / (s + 1)})
        ckpt.mirror.wait()
    ckpt.close()
    local, bucket = DirRoot(tmp_path / "local"), open_root(url)
    assert isinstance(bucket, BucketRoot) and bucket.steps() == local.steps() == [2, 1]
    assert _tier_answers(bucket, 2) == _tier_answers(local, 2)
    info = bucket.latest()
    assert info is not None and info.step == 2 and info.complete and info.url == f"{url}/{step_dir_name(2)}"
    assert type(info) is type(local.inspect(2))  # one record for every tier
    assert bucket.read_marker(2) == (tmp_path / "local" / step_dir_name(2) / MARKER).read_bytes()
    assert bucket.read_manifest(2).files == local.read_manifest(2).files
    bucket.delete(2)
    latest = bucket.latest()
    assert latest is not None and latest.step == 1
    assert (tmp_path / "local" / step_dir_name(2) / MANIFEST).exists()  # the bucket's delete is the bucket's

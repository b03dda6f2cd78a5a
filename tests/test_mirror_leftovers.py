"""What killed transfers leave: abandoned multipart uploads and attempt folders on the bucket
(the real S3 server, with the clock injected), partial download directories locally."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.core import tiny_state
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import INPROGRESS, step_dir_name
from slurmresume.checkpoint.leftovers import note
from slurmresume.mirror import parse_s3_url
from slurmresume.mirror.leftovers import (
    ABANDONED_AFTER_S,
    Upload,
    plan_folders,
    plan_uploads,
    remove_abandoned,
    remove_partial_downloads,
)
from slurmresume.retention import DEFAULT_YOUNG_THRESHOLD
from slurmresume.storage import bucketsteps

A, B = "attempt-" + "a" * 32, "attempt-" + "b" * 32


@pytest.mark.parametrize(("age", "aborted"), [(0, False), (ABANDONED_AFTER_S - 1, False), (ABANDONED_AFTER_S + 1, True)])
def test_plan_uploads_by_age(age: float, aborted: bool) -> None:
    up = Upload("p/step_000000001/x", "id", 1000.0)
    assert plan_uploads([up], now=1000.0 + age) == ([up] if aborted else [])


def test_plan_folders_keeps_committed_steps_and_any_folder_written_recently() -> None:
    now = 100_000.0
    old, fresh = now - ABANDONED_AFTER_S - 10, now - 5
    objects = [(f"step_000000001/{A}/rank-0", old), (f"step_000000001/{A}/manifest.json", old),  # abandoned
               (f"step_000000002/{B}/rank-0", old), (f"step_000000002/{B}/rank-1", fresh),  # still written to
               (f"step_000000003/{A}/rank-0", old),  # step 3 is committed: commit.sweep's business
               ("step_000000004/rank-0", old)]  # the layout before attempt folders: never touched here
    assert plan_folders(objects, {3}, now) == [f"step_000000001/{A}/rank-0", f"step_000000001/{A}/manifest.json"]


def test_abandoned_uploads_and_folders_on_the_bucket_are_removed_only_when_old(s3, tmp_path: Path) -> None:
    url = unique_url()
    loc = parse_s3_url(url)
    ckpt = Checkpointer(tmp_path / "r", handle_signals=False, mirror=url)
    ckpt.save(5, tiny_state(5))
    ckpt.close()
    killed = loc.key(7, f"{A}/rank-00000-of-00001.safetensors")
    s3.put_object(Bucket=loc.bucket, Key=loc.key(7, f"{A}/manifest.json"), Body=b"{}")
    s3.create_multipart_upload(Bucket=loc.bucket, Key=killed)

    def uploads() -> list[str]:
        return [u["Key"] for u in s3.list_multipart_uploads(Bucket=loc.bucket, Prefix=loc.prefix).get("Uploads") or []]

    assert remove_abandoned(s3, loc, time.time()) == 0  # a writer may still be at it
    assert uploads() == [killed]
    assert remove_abandoned(s3, loc, time.time() + ABANDONED_AFTER_S + 60) == 2
    assert uploads() == []
    assert [rs.step for rs in bucketsteps.scan(s3, loc)] == [5]
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 5 and info.verified


def _partial(root: Path, name: str, *, pid: int | None, mtime: float) -> Path:
    """A download folder as a pull leaves it: a shard written so far, and (unless `pid` is
    None) the `.inprogress` note naming the pulling process."""
    d = root / name
    d.mkdir(parents=True)
    (d / "rank-00000-of-00001.safetensors").write_bytes(b"x" * 100)
    if pid is not None:
        (d / INPROGRESS).write_bytes(note(pid))
    for p in (*d.iterdir(), d):
        os.utime(p, (mtime, mtime))
    return d


def test_the_next_pull_removes_a_dead_pulls_folder_and_keeps_a_live_or_unproven_one(s3, tmp_path: Path) -> None:
    """One rule for every leftover folder (DESIGN section 8): removed only when its writer is
    provably dead and it has been idle; a live pull's folder is kept however old its files."""
    url = unique_url()
    src, root = tmp_path / "src", tmp_path / "root"
    ckpt = Checkpointer(src, handle_signals=False, mirror=url)
    ckpt.save(2, tiny_state(2))
    ckpt.close()
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    pulling = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        old = time.time() - 3600
        dead = _partial(root, f".mirror-download.{step_dir_name(2)}.{exited.pid}.deadbeef", pid=exited.pid, mtime=old)
        live = _partial(root, f".mirror-download.{step_dir_name(2)}.{pulling.pid}.feedface", pid=pulling.pid, mtime=old)
        unproven = _partial(root, f".mirror-download.{step_dir_name(2)}.1.0badf00d", pid=None, mtime=old)
        ckpt = Checkpointer(root, handle_signals=False, mirror=url)
        assert ckpt.restore(tiny_state(0)) == 2
        ckpt.close()
        assert not dead.exists()
        assert live.exists() and (live / "rank-00000-of-00001.safetensors").read_bytes() == b"x" * 100
        assert unproven.exists()  # no note: its writer may still run
        pulling.kill()
        pulling.wait()
        assert remove_partial_downloads(root, time.time()) == [live.name]  # now provably dead
        assert unproven.exists()
    finally:
        pulling.kill()
        pulling.wait()


def test_a_dead_pulls_folder_written_moments_ago_is_kept_until_idle(tmp_path: Path) -> None:
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    d = _partial(tmp_path, f".mirror-download.{step_dir_name(3)}.{exited.pid}.abcdef01", pid=exited.pid,
                 mtime=time.time())
    assert remove_partial_downloads(tmp_path, time.time()) == []
    assert remove_partial_downloads(tmp_path, time.time() + DEFAULT_YOUNG_THRESHOLD + 1) == [d.name]


@pytest.mark.parametrize(("events", "behind", "warned"), [
    ([], False, False),
    ([{"event": "mirror_uploaded", "step": 4}], False, False),
    ([{"event": "mirror_uploaded", "step": 4}, {"event": "mirror_failed", "step": 6, "error": "timeout"}], False, True),
    ([{"event": "mirror_failed", "step": 6}, {"event": "mirror_behind", "step": 6, "error": "down"}], True, False),
    ([{"event": "mirror_behind", "step": 6}, {"event": "mirror_uploaded", "step": 5}], True, False),
    ([{"event": "mirror_behind", "step": 6}, {"event": "mirror_uploaded", "step": 6}], False, False),
    ([{"event": "mirror_behind", "step": 6}, {"event": "mirror_uploaded", "step": 9}], False, False),
])
def test_the_mirror_lag_read_from_the_log(events: list, behind: bool, warned: bool) -> None:
    from slurmresume.tools.health import mirror_behind, mirror_warning

    assert (mirror_behind(events) is not None) == behind
    assert (mirror_warning(events) is not None) == warned

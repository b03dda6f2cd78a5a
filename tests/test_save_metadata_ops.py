"""Metadata operations of a save on the shared step directory, counted through the fsio seam.

A save's ranks write into one shared directory. Each rank creates, fsyncs and renames its own
shard (W of each: they are the data), but the directory itself is fsynced by rank 0 alone, with
the manifest, after every rank has reported its rename and before the marker: W ranks fsyncing
one directory would be W operations on one metadata server, and only rank 0's orders anything.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from helpers.core import tiny_state

from slurmresume.checkpoint import commit, fsio
from slurmresume.checkpoint.collective import Group
from slurmresume.checkpoint.state import flatten
from slurmresume.checkpoint.store import find_latest


def _traced_save(root: Path, world: int, step: int, trace: Path, monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """The labels crossed by one `world`-rank save through the real prepare / write_rank / commit
    protocol (every rank in this process), counted."""
    trace.write_text("")
    monkeypatch.setattr(fsio, "_TRACE", str(trace))
    monkeypatch.setattr(fsio, "_ACTIVE", True)
    decision = commit.prepare(root, step)
    assert decision.action == "write", decision
    reports = []
    for rank in range(world):
        skeleton, tensors = flatten(tiny_state(step), {})
        reports.append(commit.write_rank(root, step, Group(None, rank, world), skeleton, tensors,
                                         into=decision.dir))
    outcome = commit.commit(root, step, reports, None, None, into=decision.dir)
    assert outcome.ok, outcome
    monkeypatch.setattr(fsio, "_ACTIVE", False)
    # a lease heartbeat another test of this worker left running crosses `*.owner` labels into the
    # process-wide trace: not this save's (it takes no lease: no Checkpointer here)
    return Counter(label for label in trace.read_text().split() if not label.endswith(".owner"))


def test_directory_fsyncs_per_save_do_not_grow_with_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    small = _traced_save(root, 3, 1, tmp_path / "t3", monkeypatch)
    large = _traced_save(root, 6, 2, tmp_path / "t6", monkeypatch)

    def total(c: Counter[str], prefix: str) -> int:
        return sum(n for label, n in c.items() if label.startswith(prefix))

    # the step directory is fsynced once (rank 0, before publishing); the root twice; the manifest,
    # marker and note once each: the same at 3 and at 6 ranks (the old code: one more per rank)
    assert small["fsyncdir.step"] == large["fsyncdir.step"] == 1, (small, large)
    assert total(small, "fsyncdir.") == total(large, "fsyncdir.") == 6, (small, large)
    # per rank: its shard and its index file (format 2), each one create, one fsync, one rename
    for c, world in ((small, 3), (large, 6)):
        assert c["write.shard.header"] == c["fsync.shard"] == c["rename.shard"] == world, c
        assert c["write.index"] == c["fsync.index"] == c["rename.index"] == world, c
        assert total(c, "fsync.") == 2 * world + 3  # + note, manifest, marker
    latest = find_latest(root, verify=True)
    assert latest is not None and latest.step == 2 and latest.manifest is not None
    assert latest.manifest.world_size == 6

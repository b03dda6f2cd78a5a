"""The chosen manifest from rank 0's broadcast (#29: metadata operations per restore <= 4 x W).

Rank 0 reads and validates manifest.json when it chooses the step; it then sends those very bytes
to every rank by one broadcast (`restoreload.share_manifest`), and a rank other than 0 builds its
Manifest from them (`manifest.read_pinned(..., sent)`: their digest must be the one rank 0
pinned), never opening the file: one open of manifest.json per restore instead of W. When rank 0
has no bytes to send, every other rank reads the file as before.

The multi-rank tests fork 3 gloo ranks with tests/test_restore_errors.py's harness; each rank
counts its own opens of manifest.json at the os seam (os.open, builtins.open).
"""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from slurmresume import Checkpointer
from slurmresume.checkpoint.collective import Group
from slurmresume.checkpoint.layout import MANIFEST
from slurmresume.errors import CorruptCheckpointError
from tests.test_restore_errors import WORLD, run_ranks, save_two_steps, values


def count_manifest_opens() -> list[int]:
    """From now on, this process counts its opens of any file named manifest.json (os.open and
    builtins.open); returns the one-element counter."""
    opened = [0]
    real_os_open, real_open = os.open, builtins.open

    def os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        opened[0] += os.fspath(path).endswith("/" + MANIFEST) if isinstance(path, (str, os.PathLike)) else 0
        return real_os_open(path, *args, **kwargs)

    def py_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        opened[0] += os.fspath(file).endswith("/" + MANIFEST) if isinstance(file, (str, os.PathLike)) else 0
        return real_open(file, *args, **kwargs)

    os.open, builtins.open = os_open, py_open  # forked rank: this process only
    return opened


def restore_counting(root: Path, rank0_without_bytes: bool = False) -> Any:
    """A rank's body: count manifest.json opens, restore {"model": {"w"}} into zeros; returns the
    step, whether it is bitwise the saved tensor, and the opens. `rank0_without_bytes`: rank 0's
    manifest comes without its bytes (a manifest `read_manifest` did not read)."""

    def body(rank: int) -> dict[str, Any]:
        if rank0_without_bytes and rank == 0:
            from slurmresume.checkpoint import store

            real = store.read_manifest

            def bytesless(*args: Any, **kwargs: Any) -> Any:
                m = real(*args, **kwargs)
                m.raw_bytes = None
                return m
            store.read_manifest = bytesless
        opened = count_manifest_opens()
        w = torch.zeros(1024)
        ck = Checkpointer(root, handle_signals=False)
        step = ck.restore({"model": {"w": w}})
        ck.close()
        return {"step": step, "exact": torch.equal(w, values(step, rank)), "opens": opened[0]}

    return body


def test_the_other_ranks_restore_bitwise_from_rank_0s_bytes_without_opening_the_manifest(tmp_path: Path) -> None:
    """3 ranks: rank 0 opens manifest.json (its pick), ranks 1 and 2 never do; every rank
    restores step 2 bitwise. On the old code each of ranks 1 and 2 opened it once."""
    root = save_two_steps(tmp_path)
    ranks = run_ranks(tmp_path / "restore", restore_counting(root))
    assert [r.exitcode for r in ranks] == [0] * WORLD, [(r.exitcode, r.error) for r in ranks]
    assert [(r.result["step"], r.result["exact"]) for r in ranks] == [(2, True)] * WORLD
    assert ranks[0].result["opens"] >= 1
    assert [r.result["opens"] for r in ranks[1:]] == [0] * (WORLD - 1)


def test_without_rank_0s_bytes_the_other_ranks_read_the_file_as_before(tmp_path: Path) -> None:
    """Rank 0's manifest has no bytes to send: an empty payload, and ranks 1 and 2 each open the
    file once (checked against the pinned digest), restoring step 2 bitwise."""
    root = save_two_steps(tmp_path)
    ranks = run_ranks(tmp_path / "restore", restore_counting(root, rank0_without_bytes=True))
    assert [r.exitcode for r in ranks] == [0] * WORLD, [(r.exitcode, r.error) for r in ranks]
    assert [(r.result["step"], r.result["exact"]) for r in ranks] == [(2, True)] * WORLD
    assert [r.result["opens"] for r in ranks[1:]] == [1] * (WORLD - 1)


def test_bytes_damaged_on_the_way_to_one_rank_make_every_rank_fall_back(tmp_path: Path) -> None:
    """Rank 1 receives step 2's manifest with its last byte changed ("}" -> " ": plain JSON would
    parse the same data): its plan refuses them (not the digest rank 0 pinned), the verdict is
    collective, and every rank restores step 1 bitwise, whose bytes arrive intact. On the old code
    nothing of the manifest crossed ranks: step 2 was restored."""
    root = save_two_steps(tmp_path)
    restore = restore_counting(root)

    def body(rank: int) -> Any:
        if rank == 1:
            import torch.distributed as dist

            real, damaged = dist.broadcast, [False]

            def broadcast(tensor: Any, *args: Any, **kwargs: Any) -> Any:
                out = real(tensor, *args, **kwargs)
                if (not damaged[0] and tensor.dtype == torch.uint8 and tensor.numel() > 2
                        and bytes(tensor[:2].numpy()) == b"{\"" and b"\"created\"" in bytes(tensor.numpy())):
                    damaged[0] = True  # the first manifest only: step 2's
                    tensor[-1] = ord(" ")
                return out
            dist.broadcast = broadcast
        return restore(rank)

    ranks = run_ranks(tmp_path / "restore", body)
    assert [r.exitcode for r in ranks] == [0] * WORLD, [(r.exitcode, r.error) for r in ranks]
    assert [(r.result["step"], r.result["exact"]) for r in ranks] == [(1, True)] * WORLD
    assert "falling back" in ranks[0].log and "the bytes rank 0 sent for step 2 do not match" in ranks[0].log
    assert [r.result["opens"] for r in ranks[1:]] == [0] * (WORLD - 1)  # step 1 came by broadcast too


def test_a_plan_builds_its_manifest_from_the_bytes_sent_and_refuses_other_bytes(tmp_path: Path) -> None:
    """One process, rank 1's plan of rank 0's choice as it crosses the wire: from the bytes rank 0
    read it plans with manifest.json gone from the directory; bytes that differ (one byte of
    whitespace) are refused, naming what rank 0 sent (in a restore: that rank's plan Failure)."""
    from helpers.core import save_steps, step_dir, tiny_state

    from slurmresume.checkpoint.state import flatten_live
    from slurmresume.train import messages, restorechoice, restoreplan

    save_steps(tmp_path, [1]).close()
    choice = restorechoice.pick(tmp_path, None, False, set(), False, None)
    assert isinstance(choice, messages.RestoreChoice) and choice.manifest is not None
    raw = choice.manifest.raw_bytes
    assert raw is not None and raw == (step_dir(tmp_path, 1) / MANIFEST).read_bytes()
    wire = messages.pick_from_json(json.loads(json.dumps(messages.pick_to_json(choice))))
    assert isinstance(wire, messages.RestoreChoice) and wire.manifest is None
    (step_dir(tmp_path, 1) / MANIFEST).unlink()  # what a rank may not open
    state = tiny_state(7)
    live = flatten_live(state)
    planned = restoreplan.with_manifest(wire, raw)
    assert planned.manifest is not None and planned.manifest.digest == choice.manifest_xxh3
    assert planned.manifest.raw_bytes is None  # nothing of the bytes kept
    good = restoreplan.plan_part(1, planned, state, live, True)
    assert isinstance(good, restoreplan.Part), good
    good.opened.close()
    with pytest.raises(CorruptCheckpointError, match="the bytes rank 0 sent for step 1 do not match the checksum"):
        restoreplan.with_manifest(wire, raw.replace(b"{", b"{ ", 1))
    assert restoreplan.with_manifest(choice, b"") is choice  # rank 0: its own parse


def test_a_world_of_one_sends_nothing_and_opens_the_manifest_once(tmp_path: Path) -> None:
    """World size 1: broadcast_bytes gives its input back, share_manifest returns nothing to parse
    (rank 0 has its parse) and drops rank 0's copy; a restore opens manifest.json once (the pick)
    and loads bitwise."""
    from helpers.core import model_equal, save_steps, tiny_state

    from slurmresume.train import messages, restorechoice, restoreload

    group = Group()
    payload = b"\x00\x01 bytes"
    assert group.broadcast_bytes(payload) is payload and group.broadcast_bytes(b"") == b""
    save_steps(tmp_path, [1, 2]).close()
    choice = restorechoice.pick(tmp_path, None, False, set(), False, None)
    assert isinstance(choice, messages.RestoreChoice) and choice.manifest.raw_bytes
    assert restoreload.share_manifest(group, choice) == b"" and choice.manifest.raw_bytes is None

    real_os_open, opened = os.open, []
    saved = tiny_state(2)
    state = tiny_state(99)

    def os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        opened.append(os.fspath(path))
        return real_os_open(path, *args, **kwargs)

    os.open = os_open
    try:
        ck = Checkpointer(tmp_path, handle_signals=False)
        step = ck.restore(state)
        ck.close()
    finally:
        os.open = real_os_open
    assert step == 2 and sum(p.endswith("/" + MANIFEST) for p in opened) == 1
    assert state["step"] == 2 and model_equal(state["model"], saved["model"])


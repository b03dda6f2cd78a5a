"""Issue #13, item 6: no half-loaded state, no unverified byte, no silent fresh start.

Every byte a default restore loads is checked against the per-block digests the manifest
recorded at save time; a mismatch falls back like any corruption, and with nothing older the
restore refuses instead of loading garbage or starting over from step 0."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from helpers.core import (
    model_equal,
    restore_fresh,
    save_steps,
    shard,
    step_dir,
    tiny_model,
    tiny_state,
)
from helpers.procs import HELPERS, run_ranks

from slurmresume import Checkpointer, CheckpointError, ConfigError
from slurmresume.checkpoint.shardread import read_header


def flip_byte(path: Path, tensor: str, at: float = 0.5) -> None:
    """Flip one bit of one byte inside `tensor`'s data in the shard at `path` (sizes intact)."""
    header, start = read_header(path.parent, path.name, path.stat().st_size)
    begin, end = header[tensor]["data_offsets"]
    pos = start + begin + int((end - begin - 1) * at)
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x10]))


def test_one_flipped_byte_falls_back_with_the_default_restore(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_steps(tmp_path, [1, 2]).close()
    flip_byte(shard(tmp_path, 2), "model/0.weight")
    step, state = restore_fresh(tmp_path)  # default: verify_on_restore=False
    assert step == 1 and model_equal(state["model"], tiny_model(1))
    assert any("model/0.weight' fails its checksum" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("tensor", ["model/0.weight", "extra"])
def test_one_flipped_byte_and_nothing_older_refuses(tmp_path: Path, tensor: str) -> None:
    """A live parameter (read in place) or a plain tensor value (read into fresh memory): either
    way a refusal, never garbage and never step 0."""
    state = tiny_state(2)
    state["extra"] = torch.arange(64, dtype=torch.float32)
    ck = Checkpointer(tmp_path, handle_signals=False)
    ck.save(2, state)
    ck.close()
    flip_byte(shard(tmp_path, 2), tensor)
    live = tiny_state(5)
    live["extra"] = torch.zeros(64)
    with pytest.raises(CheckpointError, match="checksum|refusing a fresh start"):
        Checkpointer(tmp_path, handle_signals=False).restore(live)


def test_a_flipped_header_byte_in_a_plain_value_is_caught(tmp_path: Path) -> None:
    """The skeleton (plain values like step counters) lives in the header: its bytes are covered too."""
    save_steps(tmp_path, [1, 2]).close()
    path = shard(tmp_path, 2)
    raw = path.read_bytes()
    at = raw.index(b'tag')  # a plain value inside the JSON skeleton: s2 -> s3 still parses
    at = raw.index(b"s2", at)
    path.write_bytes(raw[: at + 1] + b"3" + raw[at + 2 :])
    step, state = restore_fresh(tmp_path)
    assert step == 1 and state["extra"]["tag"] == "s1"


def test_transient_read_errors_are_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One EIO opening the newest manifest and one ESTALE reading its shard: step 2 still loads
    (it used to be skipped as corrupt, loading step 1)."""
    save_steps(tmp_path, [1, 2]).close()
    manifest, shard2 = str(step_dir(tmp_path, 2) / "manifest.json"), shard(tmp_path, 2)
    real_open, real_preadv = os.open, os.preadv
    failed: list[str] = []

    def flaky_open(path, *a, **k):  # type: ignore[no-untyped-def]
        if os.fspath(path) == manifest and "open" not in failed:
            failed.append("open")
            raise OSError(errno.EIO, "injected EIO", path)
        return real_open(path, *a, **k)

    def flaky_preadv(fd, bufs, offset):  # type: ignore[no-untyped-def]
        if os.readlink(f"/proc/self/fd/{fd}") == str(shard2) and "read" not in failed:
            failed.append("read")
            raise OSError(errno.ESTALE, "injected ESTALE")
        return real_preadv(fd, bufs, offset)

    monkeypatch.setattr(os, "open", flaky_open)
    monkeypatch.setattr(os, "preadv", flaky_preadv)
    step, state = restore_fresh(tmp_path)
    assert failed == ["open", "read"]
    assert step == 2 and model_equal(state["model"], tiny_model(2))


def test_no_silent_fresh_start_under_committed_steps(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2]).close()
    for s in (1, 2):
        os.truncate(shard(tmp_path, s), 100)
    with pytest.raises(CheckpointError, match=r"refusing a fresh start.*2 committed step directories.*"
                                              r"allow_fresh_start=True.*SLURMRESUME_ALLOW_FRESH_START=1"):
        restore_fresh(tmp_path)
    assert restore_fresh(tmp_path, allow_fresh_start=True)[0] == 0


def test_fresh_start_allowed_when_no_step_was_ever_committed(tmp_path: Path) -> None:
    """A first save killed before its marker leaves a directory without one: that is no progress."""
    save_steps(tmp_path, [1]).close()
    (step_dir(tmp_path, 1) / "COMMITTED").unlink()
    assert restore_fresh(tmp_path)[0] == 0


def test_a_killed_writers_temp_files_are_cleaned_at_restore(tmp_path: Path) -> None:
    save_steps(tmp_path, [1, 2]).close()
    d = step_dir(tmp_path, 2)
    leftovers = [d / ".rank-00000-of-00001.safetensors.tmp.424242", d / ".manifest.json.tmp.424242",
                 d / ".rank-00000.index.json.tmp.424242"]
    for p in leftovers:
        p.write_bytes(b"\0" * 4096)
    step, state = restore_fresh(tmp_path)
    assert step == 2 and model_equal(state["model"], tiny_model(2))
    assert not any(p.exists() for p in leftovers)
    assert sorted(os.listdir(d)) == ["COMMITTED", "manifest.json", "rank-00000-of-00001.safetensors",
                                     "rank-00000.index.json"]


def test_another_param_grouping_is_refused_before_anything_loads(tmp_path: Path) -> None:
    model = tiny_model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    ck = Checkpointer(tmp_path, handle_signals=False)
    ck.save(1, {"model": model, "optimizer": opt})
    ck.close()
    live = tiny_model(7)
    decay = [p for p in live.parameters() if p.ndim == 2]
    no_decay = [p for p in live.parameters() if p.ndim < 2]
    live_opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])
    with pytest.raises(ConfigError, match=r"state\['optimizer'\]: optimizer.param_groups: 2 group\(s\) of \[2, 2\] "
                                          r"parameters here, 1 group\(s\) of \[4\] in the checkpoint"):
        Checkpointer(tmp_path, handle_signals=False).restore({"model": live, "optimizer": live_opt})
    assert model_equal(live, tiny_model(7))  # untouched


def _torchrun(nproc: int, *args: str | Path) -> None:
    res = run_ranks(nproc, HELPERS / "verify_reshard.py", *args, timeout=300)  # forked ranks: the launch is not under test
    assert res.returncode == 0, res.stderr[-4000:]


@pytest.mark.slow
def test_three_rank_save_restored_on_two_ranks_with_a_flipped_byte(tmp_path: Path) -> None:
    """The issue's case: saved on 3 ranks, restored on 2 by byte ranges (resharding), one flipped
    byte in a piece both new ranks read part of: the restore falls back to step 1, exactly."""
    root, out = tmp_path / "ck", tmp_path / "out"
    out.mkdir()
    _torchrun(3, "save", root)
    flip_byte(step_dir(root, 2) / "rank-00001-of-00003.safetensors", "emb", at=0.3)
    _torchrun(2, "restore", root, out)
    for rank in (0, 1):
        got = json.loads((out / f"{rank}.json").read_text())
        assert got == {"step": 1, "value": 1, "equals": [1]}, got

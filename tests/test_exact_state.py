"""What restore hands to user code: every tensor owns exactly its bytes (a view into a shared read
buffer crashed `Generator.set_state`), a `torch.Generator` is a state member, plain tensors go
back to their device."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers.procs import run_python

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("members", ["gen_state", "gen,gen_state"])
@pytest.mark.parametrize("mode", ["verify", "fallback"])
def test_generator_state_restores_on_every_path(tmp_path: Path, mode: str, members: str) -> None:
    """A plain generator-state tensor (segfaulted on the old code) and a torch.Generator member
    (refused by the old code), restored with verification and by falling back past a damaged
    newest checkpoint: the draws after the restore are the ones the saved state makes."""
    res = run_python([HERE / "helpers" / "gen_restore.py", tmp_path / "ck", mode, members], timeout=300)
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout[-1500:]}\n{res.stderr[-3000:]}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["step"] == (2 if mode == "verify" else 1)
    assert out["draws"] == out["expected"]
    assert out["owns"] is True


@pytest.mark.parametrize(("recorded", "loaded", "cuda", "expected"), [
    (None, "cpu", 2, None),              # saved from the CPU: stays on the CPU
    ("cuda:1", "cpu", 2, "cuda:1"),      # back onto the GPU it was saved from
    ("cuda:3", "cpu", 2, "cuda"),        # that GPU is gone: the current one
    ("cuda:0", "cpu", 0, None),          # no CUDA here: the CPU
    ("cuda:0", "meta", 2, None),         # shape-only decode (check_fits): never moved
    ("mps:0", "cpu", 2, None),           # not CUDA: the CPU
])
def test_plain_tensor_device_decision(recorded: str | None, loaded: str, cuda: int, expected: str | None) -> None:
    from slurmresume.checkpoint.state import saved_device

    assert saved_device(recorded, loaded, cuda) == expected


def test_plain_tensor_device_is_recorded_and_live_device_wins() -> None:
    import torch

    from slurmresume.checkpoint.state import flatten, live_device

    skeleton, _ = flatten({"hidden": (torch.zeros(2, device="meta"), torch.ones(2)), "batch": torch.ones(1)}, {})
    assert skeleton["devices"] == {"hidden/0": "meta"}  # only non-CPU tensors are recorded
    saved = {"h": (torch.ones(2), torch.ones(2)), "n": 3}
    live = {"h": (torch.zeros(2), torch.zeros(2)), "n": 1}
    moved = live_device(saved, live)
    assert isinstance(moved["h"], tuple) and moved["h"][0] is saved["h"][0] and moved["n"] == 3

"""What restore hands to user code: every tensor owns exactly its bytes (a view into a shared read
buffer crashed `Generator.set_state`), a `torch.Generator` is a state member, plain tensors go
back to their device."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.procs import run_python

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize("members", ["gen_state", "gen,gen_state"])
@pytest.mark.parametrize("mode", ["verify", "fallback", "default"])
def test_generator_state_restores_on_every_path(tmp_path: Path, mode: str, members: str) -> None:
    """A plain generator-state tensor (segfaulted on the old code) and a torch.Generator member
    (refused by the old code), restored with verification and by falling back past a damaged
    newest checkpoint: the draws after the restore are the ones the saved state makes."""
    res = run_python([HERE / "helpers" / "gen_restore.py", tmp_path / "ck", mode, members], timeout=300)
    assert res.returncode == 0, f"rc {res.returncode}\n{res.stdout[-1500:]}\n{res.stderr[-3000:]}"
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["step"] == (1 if mode == "fallback" else 2)
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


def test_plain_tensors_come_back_on_the_cpu_and_own_their_bytes(tmp_path: Path) -> None:
    """On the CPU (all this machine has): plain tensors nested in tuples/dicts come back equal,
    on the live value's device, each owning exactly its bytes."""
    import torch

    import slurmresume

    saved = {"hidden": (torch.arange(6.0).reshape(2, 3), torch.ones(4)), "batch": {"x": torch.arange(5)}}
    ckpt = slurmresume.Checkpointer(tmp_path / "ck", handle_signals=False)
    ckpt.save(1, dict(saved))
    ckpt.close()
    live = {"hidden": (torch.zeros(2, 3), torch.zeros(4)), "batch": {"x": torch.zeros(5, dtype=torch.int64)}}
    restorer = slurmresume.Checkpointer(tmp_path / "ck", handle_signals=False)
    assert restorer.restore(live) == 1
    restorer.close()
    for got, want in ((live["hidden"][0], saved["hidden"][0]), (live["hidden"][1], saved["hidden"][1]),
                      (live["batch"]["x"], saved["batch"]["x"])):
        assert torch.equal(got, want) and got.device.type == "cpu"
        assert got.storage_offset() == 0 and got.untyped_storage().nbytes() == got.nbytes


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="needs a CUDA device")
def test_plain_tensors_go_back_to_the_gpu(tmp_path: Path) -> None:
    """A hidden state and a prefetched batch saved from the GPU come back on the GPU: onto the
    live value's device when the state holds one there, else onto the device they were saved
    from (read from the manifest's skeleton)."""
    import torch

    import slurmresume

    dev = torch.device("cuda", torch.cuda.current_device())
    saved = {"hidden": (torch.randn(2, 3, device=dev), torch.randn(4, device=dev)),
             "batch": torch.arange(5, device=dev), "cpu_side": torch.ones(2)}
    ckpt = slurmresume.Checkpointer(tmp_path / "ck", handle_signals=False)
    ckpt.save(1, dict(saved))
    ckpt.close()
    live = {"hidden": (torch.zeros(2, 3, device=dev), torch.zeros(4, device=dev)), "batch": None,
            "cpu_side": torch.zeros(2)}
    restorer = slurmresume.Checkpointer(tmp_path / "ck", handle_signals=False)
    assert restorer.restore(live) == 1
    restorer.close()
    assert all(t.device == dev for t in live["hidden"])  # the live value's device
    assert live["batch"].device == dev  # no live tensor: the device it was saved from
    assert live["cpu_side"].device.type == "cpu"
    assert all(torch.equal(a, b) for a, b in zip(live["hidden"], saved["hidden"], strict=True))
    assert torch.equal(live["batch"], saved["batch"])

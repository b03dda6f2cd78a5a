"""Elastic resume: a data-parallel checkpoint stores replicated tensors once and loads on
another world size; per-rank (sharded) tensors refuse a different world size."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.procs import run_ranks
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"

# One worker runs this module, so that its module-scoped fixture (a multi-process run) is
# computed once: under xdist each worker that got one of its tests computed it again.
pytestmark = pytest.mark.xdist_group("elastic")
# The ranks are forked from one process that imported torch and torch._dynamo (an optimizer
# imports it) once (helpers/forkranks.py): what is tested is the checkpoint, not the launch.
DYNAMO = ("torch._dynamo",)

PROBE = r'''
import os, sys, torch, torch.distributed as dist, slurmresume
from safetensors.torch import load_file
if "RANK" in os.environ:
    dist.init_process_group("gloo")
rank = dist.get_rank() if dist.is_initialized() else 0
torch.manual_seed(0)
sys.argv = [sys.argv[0]]
mode = os.environ["PROBE_MODE"]
root = os.environ["SLURMRESUME_CKPT_DIR"]
if mode == "sharded-save":
    w = torch.nn.Parameter(torch.full((4,), float(rank)))
    slurmresume.Checkpointer(handle_signals=False).save(1, {"w": {"v": w.data}})
    raise SystemExit(0)
if mode == "sharded-load":
    slurmresume.Checkpointer(handle_signals=False).restore({"w": None})
    raise SystemExit(0)
# load the example's model/optimizer shapes by reading the saved tensors as plain dicts
ck = slurmresume.Checkpointer(handle_signals=False)
state = {"model": {}, "optimizer": {}, "scheduler": {}, "sampler": {}, "loss": 0.0}
class Box:
    def __init__(self): self.sd = None
    def state_dict(self): return {}
    def load_state_dict(self, sd): self.sd = sd
boxes = {k: Box() for k in ("model", "optimizer", "scheduler", "sampler")}
state = {**boxes, "loss": 0.0}
step = ck.restore(state)
out = {"step": step, "rank": rank, "model": {k: v.sum().item() for k, v in boxes["model"].sd.items()},
       "sampler": boxes["sampler"].sd}
out_dir = os.environ["PROBE_OUT"]
open(os.path.join(out_dir, f"probe{rank}.json"), "w").write(__import__("json").dumps(out))
'''


def _run(args: list[str], env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def ddp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ddp") / "ck"
    res = run_ranks(2, EXAMPLE, "--steps", "10", "--save-every", "10", "--batch-size", "4", "--ckpt-dir", str(root),
                    env={**__import__("os").environ}, timeout=300, preload=DYNAMO)
    assert res.returncode == 0, res.stderr[-3000:]
    return root


@pytest.mark.slow
def test_replicated_tensors_are_stored_once(ddp_root: Path) -> None:
    d = ddp_root / "step_000000010"
    s0, s1 = (d / "rank-00000-of-00002.safetensors").stat().st_size, (d / "rank-00001-of-00002.safetensors").stat().st_size
    assert s1 < s0 / 20  # rank 1 holds only its own RNG / per-rank state
    manifest = json.loads((d / "manifest.json").read_text())
    first, second = (json.loads((d / f"rank-0000{r}.index.json").read_text())["tensors"] for r in (0, 1))
    model = [n for n in first if n.startswith("model/")]
    assert model and set(model) <= set(manifest["replicated"])
    assert not any(n.startswith("model/") for n in second)
    assert "model/head.weight" not in load_file(str(d / "rank-00001-of-00002.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 3])
def test_ddp_checkpoint_loads_on_another_world_size(ddp_root: Path, tmp_path: Path, nproc: int) -> None:
    import os

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    env = {**os.environ, "SLURMRESUME_CKPT_DIR": str(ddp_root), "PROBE_MODE": "load", "PROBE_OUT": str(tmp_path)}
    res = _run([sys.executable, str(probe)], env) if nproc == 1 else run_ranks(nproc, probe, env=env, timeout=300,
                                                                               preload=DYNAMO)
    assert res.returncode == 0, res.stderr[-3000:]
    probes = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("probe*.json"))]
    assert len(probes) == nproc and all(p["step"] == 10 for p in probes)
    saved = load_file(str(ddp_root / "step_000000010" / "rank-00000-of-00002.safetensors"))
    expect = {k.removeprefix("model/"): v.sum().item() for k, v in saved.items() if k.startswith("model/")}
    for p in probes:
        assert {k: v for k, v in p["model"].items() if k in expect} == {k: expect[k] for k in p["model"] if k in expect}
        assert p["sampler"]["num_replicas"] == 2  # the saved state; ResumableSampler rescales positions
    if nproc == 3:
        assert "re-seeded from step and rank" in res.stderr


@pytest.mark.slow
def test_sharded_state_refuses_another_world_size(tmp_path: Path) -> None:
    import os

    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    root = tmp_path / "ck"
    env = {**os.environ, "SLURMRESUME_CKPT_DIR": str(root), "PROBE_MODE": "sharded-save"}
    res = run_ranks(2, probe, env=env, timeout=300, preload=DYNAMO)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _run([sys.executable, str(probe)], {**env, "PROBE_MODE": "sharded-load"})
    assert res.returncode != 0
    assert "per-rank (sharded) tensors" in res.stderr and "giving 2 ranks" in res.stderr


def test_sampler_rescales_position_for_new_world() -> None:
    import slurmresume

    s = slurmresume.ResumableSampler(list(range(100)), num_replicas=4, rank=0, shuffle=False)
    s.load_state_dict({"epoch": 0, "position": 10, "seed": 0, "num_replicas": 2})
    assert s.position == 5  # 2 ranks x 10 samples = 20 consumed = 4 ranks x 5
    assert torch.tensor(list(iter(s))).numel() == 25 - 5

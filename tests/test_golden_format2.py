"""Checkpoints written by format 2 (slurmresume/2: per-rank index files, the manifest's shard table
as one object per shard) stay readable now that format 3 writes that table as columns: roots
committed in tests/golden/format2, written by the release before format 3 (commit 7ed38a0).

  single/root   step 5 of helpers.core.tiny_state, 1 rank
  fsdp3/root    step 3 of helpers/reshard_train.py save on 3 ranks (FSDP2 Shard(0) + AdamW,
                a Replicate() DTensor, equal pieces at different offsets); full.safetensors
                is the full state it saved
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.core import model_equal, tiny_model, tiny_state
from helpers.procs import HELPERS, run_ranks
from safetensors.torch import load_file
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint.store import inspect_dir
from slurmresume.cli import app

GOLDEN = Path(__file__).parent / "golden" / "format2"


def _copy(name: str, tmp_path: Path) -> Path:
    root = tmp_path / name
    shutil.copytree(GOLDEN / name / "root", root)
    return root


def test_golden_roots_are_format_2() -> None:
    for name, step, world in (("single", 5, 1), ("fsdp3", 3, 3)):
        d = GOLDEN / name / "root" / f"step_{step:09d}"
        manifest = json.loads((d / "manifest.json").read_text())
        assert manifest["format"] == "slurmresume/2" and isinstance(manifest["shards"], list)
        assert sorted(p.name for p in d.glob("rank-*.index.json")) == [f"rank-{r:05d}.index.json" for r in range(world)]


def test_format_2_single_rank_restores_bitwise(tmp_path: Path) -> None:
    root = _copy("single", tmp_path)
    state = tiny_state(987654)
    with Checkpointer(root, handle_signals=False) as ck:
        assert ck.restore(state) == 5
    assert model_equal(state["model"], tiny_model(5)) and state["extra"] == {"tag": "s5", "ints": (1, 2, 5)}


def test_format_2_verify_inspect_export_status(tmp_path: Path) -> None:
    root = _copy("fsdp3", tmp_path)
    info = inspect_dir(3, root / "step_000000003", verify=True)
    assert info.complete and info.verified and info.manifest is not None and info.manifest.world_size == 3
    runner = CliRunner()
    for args in (["verify", "--ckpt-dir", str(root), "--all"], ["inspect", "latest", "--ckpt-dir", str(root), "--json"],
                 ["status", "--ckpt-dir", str(root)], ["latest", "--ckpt-dir", str(root)]):
        res = runner.invoke(app, args, terminal_width=200)
        assert res.exit_code == 0, (args, res.output)
    out = tmp_path / "full.safetensors"
    res = runner.invoke(app, ["export", str(root / "step_000000003"), "--out", str(out)], terminal_width=200)
    assert res.exit_code == 0, res.output
    full, exported = load_file(str(GOLDEN / "fsdp3" / "full.safetensors")), load_file(str(out))
    assert exported.keys() == {k.removeprefix("model/") for k in full if k.startswith("model/")}
    assert all(torch.equal(exported[k], full[f"model/{k}"]) for k in exported)


@pytest.mark.parametrize("world", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_format_2_fsdp2_resumes_on_3_and_2_ranks(tmp_path: Path, world: int) -> None:
    root = _copy("fsdp3", tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(GOLDEN / "fsdp3" / "full.safetensors", out)
    res = run_ranks(world, HELPERS / "reshard_train.py", "resume", out, root, "--dim", "0",  # forked ranks
                    preload=("torch._dynamo",))  # the launch is not under test; AdamW imports torch._dynamo
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in range(world):
        result = json.loads((out / f"resume-{world}-0-{rank}.json").read_text())
        assert result["step"] == 3 and result["mismatch"] == [] and result["losses"] == result["ref_losses"]

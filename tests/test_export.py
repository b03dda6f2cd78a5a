"""`slurmresume export`: one stock safetensors file that load_state_dict accepts, bitwise equal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.procs import run_ranks
from safetensors.torch import load_file
from typer.testing import CliRunner

import slurmresume
from slurmresume.cli import app

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("counter", torch.tensor(7))


def test_export_loads_into_model_bitwise(tmp_path: Path) -> None:
    model = Tied()
    opt = torch.optim.Adam(model.parameters())
    slurmresume.Checkpointer(tmp_path / "ck", handle_signals=False).save(3, {"model": model, "opt": opt})
    out = tmp_path / "m.safetensors"
    res = CliRunner().invoke(app, ["export", "latest", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    sd = load_file(str(out))
    assert set(sd) == set(model.state_dict())  # tied weights appear under both names
    fresh = Tied()
    fresh.load_state_dict(sd, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k
    res = CliRunner().invoke(app, ["export", "-d", str(tmp_path / "ck"), "--out", str(out), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == {"schema": "slurmresume.export/1", "step": 3, "out": str(out.absolute()),
                                      "tensors": len(sd), "bytes": out.stat().st_size}


@pytest.mark.slow
def test_export_of_two_rank_checkpoint_equals_each_replica(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    res = run_ranks(2, EXAMPLE, "--steps", "10", "--save-every", "10", "--batch-size", "4", "--ckpt-dir", str(root),
                    timeout=300, preload=("torch._dynamo",))  # forked ranks (helpers/forkranks.py): the launch is not under test
    assert res.returncode == 0, res.stderr[-3000:]
    outs = []
    for rank in (0, 1):
        out = tmp_path / f"r{rank}.safetensors"
        res = CliRunner().invoke(app, ["export", "10", "--ckpt-dir", str(root), "--out", str(out), "--rank", str(rank)])
        assert res.exit_code == 0, res.output
        outs.append(load_file(str(out)))
    assert outs[0].keys() == outs[1].keys() and len(outs[0]) > 10
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k  # DDP replicas: the consolidated model


def test_export_bad_input(tmp_path: Path) -> None:
    slurmresume.Checkpointer(tmp_path / "ck", handle_signals=False).save(1, {"w": torch.ones(2)})
    r = CliRunner().invoke(app, ["export", "latest", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "no state key 'model'" in r.output
    r = CliRunner().invoke(app, ["export", "99", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o")])
    assert r.exit_code == 1 and "not a complete checkpoint" in r.output
    r = CliRunner().invoke(app, ["export", "latest", "--ckpt-dir", str(tmp_path / "nope")])
    assert r.exit_code == 1 and "does not exist" in r.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("strategy", ["direct", "direct-par", "buffered-wb", "buffered"])
def test_export_is_bitwise_on_every_write_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               strategy: str) -> None:
    """export reads each tensor into one reused buffer and feeds it to the writer. The buffered
    paths queue views of the caller's memory for a writer thread, so a reused buffer could be
    overwritten by the next read before its bytes were written: an exported model with the
    wrong weights and no error. The calibration picks a buffered path wherever that disk favours
    it (it did on 2026-12-04 here), so every path must export the same bytes."""
    gen = torch.Generator().manual_seed(5)
    # many small tensors (one read each) and one over two write chunks (several reads)
    state = {f"t{i:03d}": torch.randn(4096 + i, generator=gen) for i in range(64)}
    state["big"] = torch.randn((80 << 20) // 4, generator=gen)
    ck = slurmresume.Checkpointer(tmp_path / "ck", handle_signals=False)
    ck.save(1, {"model": state})
    ck.close()
    monkeypatch.setenv("SLURMRESUME_WRITER", strategy)
    out = tmp_path / "m.safetensors"
    res = CliRunner().invoke(app, ["export", "latest", "--ckpt-dir", str(tmp_path / "ck"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    got = load_file(str(out))
    assert set(got) == set(state)
    bad = [k for k, v in state.items() if not torch.equal(got[k], v)]
    assert not bad, f"{strategy}: {len(bad)} tensors differ, e.g. {bad[:5]}"

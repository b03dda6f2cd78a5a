"""A newcomer's first week (issue 46), the rows that wrote or reported wrong data, in the library
and the checkpoint commands: a restore into tensors it cannot write (meta, or a load that changes
nothing), two ranks without a process group, a step folder as the root, an export of a flipped
byte, `latest` on a corrupt step, a torch.compile'd model on an uncompiled root. Each refusal is
one line, and (rows 1-5) leaves every byte under the root as it was.
"""

from __future__ import annotations

import hashlib
import logging
import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from helpers.core import save_steps, tiny_state
from safetensors.torch import load_file
from typer.testing import CliRunner

from slurmresume import Checkpointer, ConfigError
from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.checkpoint.shardread import read_header
from slurmresume.cli import app

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""}


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root` (hidden ones too): a file's sha256, "dir" for a directory."""
    out: dict[str, str] = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            out[str(p.relative_to(root))] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def saved(root: Path, *steps: int) -> Path:
    save_steps(root, list(steps)).close()
    return root


def cli(*args: object, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={**ENV, **(env or {})})


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def one_line(exc: BaseException) -> str:
    """The exception's message, checked to be one line and raised alone (no chained traceback)."""
    text = str(exc)
    assert "\n" not in text, text
    printed = "".join(traceback.format_exception(exc))
    assert printed.count("Traceback (most recent call last)") == 1, printed
    return text


def model_state(model: nn.Module) -> dict[str, object]:
    return {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=0.1), "step": 0}


# -- row 1: a restore never says "restored" unless every byte landed ------------------------------

def test_restore_into_a_model_on_meta_is_refused_then_loads_once_materialised(tmp_path, caplog):
    root = tmp_path / "ck"
    ckpt = Checkpointer(root, handle_signals=False)
    trained = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ckpt.save(10, model_state(trained))
    ckpt.close()
    before = tree(root)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    caplog.set_level(logging.INFO, logger="slurmresume")
    ckpt = Checkpointer(root, handle_signals=False)
    with pytest.raises(ConfigError) as err:
        ckpt.restore(model_state(model))
    line = one_line(err.value)
    assert "state['model']" in line and "meta" in line and "to_empty" in line
    assert "restored from step" not in caplog.text
    assert all(p.device.type == "meta" for p in model.parameters())
    ckpt.close()
    assert tree(root) == before
    # what the line says to do works: materialised, every byte of step 10 lands
    model = model.to_empty(device="cpu")
    ckpt = Checkpointer(root, handle_signals=False)
    assert ckpt.restore(model_state(model)) == 10
    ckpt.close()
    for k, v in trained.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k


class IgnoresLoads(nn.Linear):
    """A module whose load_state_dict forgets to load (a hand-written override gone wrong)."""

    def load_state_dict(self, state_dict, strict=True, assign=False):  # noqa: ANN001, ANN201
        return None


def test_a_load_that_leaves_a_tensor_unchanged_is_refused(tmp_path, caplog):
    root = tmp_path / "ck"
    ckpt = Checkpointer(root, handle_signals=False)
    ckpt.save(10, {"model": nn.Linear(4, 3)})
    ckpt.close()
    before = tree(root)
    model = IgnoresLoads(4, 3)
    caplog.set_level(logging.INFO, logger="slurmresume")
    ckpt = Checkpointer(root, handle_signals=False)
    with pytest.raises(ConfigError) as err:
        ckpt.restore({"model": model})
    ckpt.close()
    line = one_line(err.value)
    assert "state['model']" in line and "'weight'" in line and "unchanged" in line
    assert "restored from step" not in caplog.text
    assert tree(root) == before


# -- row 3: two ranks that never joined a process group --------------------------------------------

@pytest.mark.parametrize("rank", ["0", "1"])
def test_two_ranks_without_a_process_group_are_refused(tmp_path, monkeypatch, rank):
    root = saved(tmp_path / "ck", 40)
    before = tree(root)
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError) as err:
        ckpt = Checkpointer(root, handle_signals=False)
        ckpt.restore(tiny_state(0))
        ckpt.step(41, tiny_state(41))
        ckpt.save(42, tiny_state(42))
    line = one_line(err.value)
    assert "WORLD_SIZE=2" in line and "init_process_group" in line
    assert tree(root) == before


# -- row 4: a step folder (or anything under one) is not a root -----------------------------------

def test_a_step_folder_as_the_root_is_refused_naming_its_root(tmp_path, monkeypatch):
    root = saved(tmp_path / "ck", 10)
    before = tree(root)
    step = root / step_dir_name(10)
    for given in (step, step / "sub", step / "sub" / "deeper"):
        monkeypatch.setenv("SLURMRESUME_CKPT_DIR", str(given))
        with pytest.raises(ConfigError) as err:
            Checkpointer(handle_signals=False).restore(tiny_state(0))
        line = one_line(err.value)
        assert f"step folder {step}" in line and f"checkpoint root {root}" in line
        with pytest.raises(ConfigError):
            Checkpointer(given, handle_signals=False).save(11, tiny_state(11))
    assert tree(root) == before
    # evidence, not names: a root of the user's that is merely called like a step folder is a root
    named = saved(tmp_path / step_dir_name(1), 3)
    ckpt = Checkpointer(named, handle_signals=False)
    assert ckpt.restore(tiny_state(0)) == 3
    ckpt.close()
    assert cli("latest", "-d", named).stdout == f"{named / step_dir_name(3)}\n"


@pytest.mark.parametrize("command", [["latest"], ["verify"], ["prune", "--keep", "1", "--yes"],
                                     ["export", "latest", "--out", "OUT"]])
def test_a_step_folder_as_the_commands_root_is_refused_naming_its_root(tmp_path, command):
    root = saved(tmp_path / "ck", 9, 10)
    before = tree(root)
    out = tmp_path / "m.safetensors"
    args = [str(out) if a == "OUT" else a for a in command]
    for given in (root / step_dir_name(10), root / step_dir_name(10) / "sub"):
        line = one_error_line(cli(*args, "-d", given))
        assert "not a checkpoint root" in line and line.endswith(f"slurmresume {args[0]} -d {root}"), line
    assert tree(root) == before and not out.exists()


# -- row 5: a flipped byte is never exported, `latest` says what it checks -------------------------

def flip_a_weight_byte(root: Path, step: int) -> None:
    shard = root / step_dir_name(step) / "rank-00000-of-00001.safetensors"
    header, start = read_header(shard.parent, shard.name, shard.stat().st_size)
    name = next(n for n in header if n.startswith("model/"))
    data = bytearray(shard.read_bytes())
    data[start + header[name]["data_offsets"][0] + 1] ^= 0x10
    shard.write_bytes(bytes(data))


def test_export_of_a_flipped_byte_writes_nothing(tmp_path):
    root = saved(tmp_path / "ck", 10)
    good = tmp_path / "good.safetensors"
    assert cli("export", "10", "-d", root, "--out", good).exit_code == 0
    flip_a_weight_byte(root, 10)
    before = tree(root)
    out = tmp_path / "out" / "m.safetensors"
    out.parent.mkdir()
    line = one_error_line(cli("export", "10", "-d", root, "--out", out))
    assert "fails its checksum" in line, line
    assert list(out.parent.iterdir()) == []  # no file, no partial temp
    assert tree(root) == before
    assert load_file(str(good))  # the good export stands


def test_latest_verify_skips_a_corrupt_step_and_help_says_what_plain_latest_checks(tmp_path):
    root = saved(tmp_path / "ck", 9, 10)
    flip_a_weight_byte(root, 10)
    before = tree(root)
    r = cli("latest", "--verify", "-d", root)
    assert r.exit_code == 0, r.output
    assert r.stdout == f"{root / step_dir_name(9)}\n"
    assert step_dir_name(10) in r.stderr and "checksum" in r.stderr  # said why it was skipped
    help_text = " ".join(cli("latest", "--help").stdout.split())
    assert "does not read the shards" in help_text and "--verify" in help_text
    assert tree(root) == before


# -- row 11: a torch.compile'd model on a root saved uncompiled ------------------------------------

class Compiled(nn.Module):
    """What torch.compile returns (OptimizedModule): the model as submodule `_orig_mod`, so every
    state_dict key gains the prefix "_orig_mod."."""

    def __init__(self, mod: nn.Module) -> None:
        super().__init__()
        self._orig_mod = mod


def test_a_compiled_model_on_an_uncompiled_root_is_one_line(tmp_path):
    root = tmp_path / "ck"
    ckpt = Checkpointer(root, handle_signals=False)
    ckpt.save(10, {"model": nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))})
    ckpt.close()
    compiled = Compiled(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2)))
    assert list(compiled.state_dict())[0] == "_orig_mod.0.weight"
    ckpt = Checkpointer(root, handle_signals=False)
    with pytest.raises(ConfigError) as err:
        ckpt.restore({"model": compiled})
    line = one_line(err.value)
    assert "_orig_mod." in line and "compiled._orig_mod" in line and "state['model']" in line
    assert ckpt.restore({"model": compiled._orig_mod}) == 10  # what it says works
    ckpt.close()


def test_an_uncompiled_model_on_a_root_saved_compiled_is_one_line(tmp_path):
    root = tmp_path / "ck"
    ckpt = Checkpointer(root, handle_signals=False)
    ckpt.save(10, {"model": Compiled(nn.Linear(4, 3))})
    ckpt.close()
    ckpt = Checkpointer(root, handle_signals=False)
    with pytest.raises(ConfigError) as err:
        ckpt.restore({"model": nn.Linear(4, 3)})
    ckpt.close()
    line = one_line(err.value)
    assert "_orig_mod." in line and "saved from a torch.compile'd module" in line


def test_compile_prefix_is_found_at_any_depth_and_only_there():
    from slurmresume.checkpoint.state import compile_mismatch

    ddp_of_compiled = {"module._orig_mod.0.weight": 1, "module._orig_mod.0.bias": 1}
    assert "compiled._orig_mod" in compile_mismatch(ddp_of_compiled, {"module.0.weight": 1, "module.0.bias": 1}, "m")
    assert compile_mismatch({"0.weight": 1}, {"1.weight": 1}, "m") is None  # another model: the usual message
    assert compile_mismatch({"_orig_mod.w": 1}, {"_orig_mod.w": 1}, "m") is None

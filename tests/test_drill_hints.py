"""Issue #28, the drill's hint table (README §Adapt your script; with each row's test in docs/adapt-your-script.md): for each row, a script
that follows the recipe except for exactly that point, and the drill's first FAIL line names the
fix (exit 1). One rank, 12 steps, one warning: each drill runs the script twice through the real
launcher (slow lane, like the other drill tests: ~15-25 s each on a quiet machine, 2-4 min under
load). The rows other files already prove are listed in docs/adapt-your-script.md with their tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "helpers" / "train_hint_cases.py"
pytestmark = pytest.mark.slow


def drill(tmp_path: Path, case: str, script: Path = SCRIPT, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(script), "--workdir", str(tmp_path / "w"),
                           "--preemptions", "1", "--seed", "3", "--", "--steps", "12", "--case", case, *args],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "COLUMNS": "400"})


def first_fail(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    fails = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    assert fails, res.stdout[-3000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stdout + res.stderr
    return fails[0]


def test_the_complete_recipe_passes(tmp_path: Path) -> None:
    """The control: the same script with nothing left out passes, so each row's failure is its own."""
    res = drill(tmp_path, "ok")
    assert res.returncode == 0 and "PASS" in res.stdout, res.stdout[-3000:] + res.stderr[-3000:]


def test_counting_steps_from_zero_after_restore_names_the_restored_step(tmp_path: Path) -> None:
    line = first_fail(drill(tmp_path, "wrong-start"))
    assert "first ckpt.step() was step 1" in line and "continue counting from the step restore() returns" in line


def test_a_sampler_never_advanced_is_named(tmp_path: Path) -> None:
    """Old code: the first line asked about the LR scheduler (the optimizer differed)."""
    line = first_fail(drill(tmp_path, "no-advance"))
    assert "sampler 'sampler' was never advanced" in line and "sampler.advance(batch_size)" in line, line


def test_a_script_owned_generator_outside_state_is_named(tmp_path: Path) -> None:
    """Old code: 'did you save the LR scheduler? Otherwise the data order or randomness is not in the state'."""
    line = first_fail(drill(tmp_path, "own-gen"))
    assert "torch.Generator" in line and 'state["gen"] = gen' in line, line


def test_rng_not_restored_names_the_stream_and_restore_rng(tmp_path: Path) -> None:
    """Old code named the stream, not `restore_rng=False`."""
    line = first_fail(drill(tmp_path, "no-rng"))
    assert "RNG stream rng.torch_cpu" in line and "restore_rng=False" in line, line


LIGHTNING_WITHOUT_CALLBACK = """
import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from slurmresume.integrations.lightning import SlurmResume  # imported, never passed to the Trainer

class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 1)
    def training_step(self, batch, _):
        return self.lin(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

pl.seed_everything(0, verbose=False)
data = DataLoader(TensorDataset(torch.randn(16, 2)), batch_size=4)
pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
           enable_progress_bar=False, enable_model_summary=False).fit(M(), data)
"""


def test_a_lightning_callback_not_passed_to_the_trainer_is_named(tmp_path: Path) -> None:
    """Old code: 'save at the end of training (ckpt.save(step, state))', which Lightning users never call."""
    pytest.importorskip("lightning")
    script = tmp_path / "pl_train.py"
    script.write_text(textwrap.dedent(LIGHTNING_WITHOUT_CALLBACK))
    res = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(script), "--workdir", str(tmp_path / "w"),
                          "--preemptions", "1"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env={**os.environ, "COLUMNS": "400"})
    assert res.returncode != 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout + res.stderr
    assert "Traceback" not in out
    assert "callbacks=[SlurmResume()]" in out and "ckpt.save" not in out, out[-3000:]

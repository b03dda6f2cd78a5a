"""`slurmresume drill` through the real launcher and torchrun: passes on the example with 1 and
2 processes, and fails (exit 1, naming the state) on a variant that forgets its scheduler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"
FORGETFUL = REPO / "tests" / "helpers" / "train_forgets_scheduler.py"
ARGS = ["--", "--steps", "24", "--save-every", "100", "--batch-size", "8"]


def drill(tmp_path: Path, script: Path, *opts: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(script), "--workdir", str(tmp_path / "w"),
                           "--json", *opts, *ARGS], capture_output=True, text=True, timeout=600, cwd=tmp_path)


# Seed 85 plans the warnings at steps 7 and 23 of 24: the last one races the end of training (a
# fast script used to finish before the launcher's relay landed, and the drill lost it).
@pytest.mark.slow
# One rank: also every other drill test (culprit, forgotten scheduler, augmentation). Several
# ranks: the same command on 3 ranks, with these assertions, is
# test_ddp_drill::test_the_example_passes_the_drill_with_no_ddp_line[3]. Both points here run
# with `bash scripts/test --exhaustive`.
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.exhaustive),
                                   pytest.param(2, marks=pytest.mark.exhaustive)])
def test_drill_passes_on_the_example(tmp_path: Path, nproc: int) -> None:
    res = drill(tmp_path, EXAMPLE, "--preemptions", "2", "--nproc-per-node", str(nproc), "--seed", "85")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    verdict = json.loads(res.stdout)  # --json: stdout is the verdict alone; the runs' output is on stderr
    assert "done at step 24" in res.stderr
    assert verdict["ok"] is True and verdict["differences"] == []
    assert verdict["planned"] == [7, 23]
    assert verdict["preemptions"] == 2 and verdict["missed"] == 0 and len(verdict["saved_steps"]) == 2
    assert all(0 < s <= 24 for s in verdict["saved_steps"])  # 2 ranks act one step later (pipelined)


@pytest.mark.slow
def test_drill_fails_on_a_script_that_forgets_its_scheduler(tmp_path: Path) -> None:
    res = drill(tmp_path, FORGETFUL, "--preemptions", "1", "--seed", "1")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-3000:]
    verdict = json.loads(res.stdout[res.stdout.index("{"):])
    assert verdict["ok"] is False
    first = verdict["differences"][0]
    assert first["key"].startswith("optimizer") and "scheduler" in first["hint"]

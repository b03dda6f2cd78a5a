"""Resume from an older step: refused without --branch/--discard-newer; a branch leaves the old
root byte-identical and continues from the chosen step."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import slurmresume
from slurmresume.cli import app
from slurmresume.tools.compare import compare_checkpoints

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and p.name != ".slurmresume.lock"}


def make_root(root: Path, steps: tuple[int, ...]) -> None:
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    for s in steps:
        ck.save(s, {"w": torch.full((4,), float(s))})


def test_refused_without_a_decision(tmp_path: Path) -> None:
    make_root(tmp_path / "r", (10, 20, 30))
    res = CliRunner().invoke(app, ["submit", "--local", str(EXAMPLE), "--ckpt-dir", str(tmp_path / "r"),
                                   "--resume-from", "10"])
    assert res.exit_code == 1
    assert "--branch" in res.output and "--discard-newer" in res.output
    assert sorted(p.name for p in (tmp_path / "r").glob("step_*")) == ["step_000000010", "step_000000020",
                                                                        "step_000000030"]


def test_discard_newer_removes_only_newer(tmp_path: Path) -> None:
    from slurmresume.tools.lineage import prepare_resume

    make_root(tmp_path / "r", (10, 20, 30))
    assert prepare_resume(tmp_path / "r", "20", branch=None, discard_newer=True) == tmp_path / "r"
    assert sorted(p.name for p in (tmp_path / "r").glob("step_*")) == ["step_000000010", "step_000000020"]
    assert slurmresume.find_latest(tmp_path / "r").step == 20
    assert not list((tmp_path / "r").glob(".deleting.*"))


@pytest.mark.slow
def test_branch_continues_from_step_and_leaves_old_root_untouched(tmp_path: Path) -> None:
    old, new = tmp_path / "old", tmp_path / "new"
    run = [sys.executable, str(EXAMPLE), "--steps", "30", "--save-every", "10", "--batch-size", "8"]
    subprocess.run([*run, "--ckpt-dir", str(old)], check=True, capture_output=True, timeout=300)
    before = tree_digest(old)
    res = subprocess.run([sys.executable, "-m", "slurmresume", "submit", "--local", str(EXAMPLE), "--ckpt-dir",
                          str(old), "--resume-from", "10", "--branch", str(new), "--",
                          "--steps", "30", "--save-every", "10", "--batch-size", "8"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert tree_digest(old) == before  # bytes compared: the old root is untouched
    events = [json.loads(x) for x in (new / "events.jsonl").read_text().splitlines()]
    assert events[0]["event"] == "branched" and events[0]["parent_step"] == 10
    assert any(e["event"] == "restored" and e["step"] == 10 for e in events)
    # continuing from 10 in the branch reproduces the original run's step 30 exactly
    assert compare_checkpoints(old / "step_000000030", new / "step_000000030") == []

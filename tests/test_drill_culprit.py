"""Issue #13, item 7: the drill names the culprit, and only real culprits.

In-process: the ranking by cause and the per-stream --ignore (two checkpoints made to differ).
Through the real drill (launcher + torchrun): a never-seeded RNG stream passes with a note; a
plain value carried outside the state is named first, before the optimizer and model it feeds,
with every differing key printed; a script that overrides the launcher's root is told so."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.procs import HELPERS

from slurmresume import Checkpointer
from slurmresume.tools.compare import compare_checkpoints, culprits, explain

SCRIPT = HELPERS / "train_drill_cases.py"


def _save(root: Path, *, ema: float, numpy_seed: int, bias: float) -> Path:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.bias.fill_(bias)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (1 + bias))
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    random.seed(1)
    np.random.seed(numpy_seed)
    ck = Checkpointer(root, handle_signals=False)
    path = ck.save(5, {"model": model, "optimizer": opt, "scheduler": sched, "ema": ema})
    ck.close()
    assert path is not None
    return path


def test_differences_are_ranked_by_cause(tmp_path: Path) -> None:
    a = _save(tmp_path / "a", ema=0.5, numpy_seed=1, bias=0.0)
    b = _save(tmp_path / "b", ema=0.7, numpy_seed=2, bias=1.0)
    diffs = compare_checkpoints(a, b)
    explain(diffs)
    tops = [d.top for d in diffs]
    assert tops[0] == "rng.numpy" and "rng.python" not in tops and "rng.torch_cpu" not in tops
    causes = [d.cause for d in diffs]
    # the lr in param_groups (what the scheduler sets) and the scheduler itself come before the
    # plain value, the optimizer's tensors and the model
    assert causes == sorted(causes, key=["rng", "hyper", "object", "value", "optimizer", "model"].index)
    assert tops.index("scheduler") < tops.index("ema") < tops.index("model")
    assert "worker-side randomness" in diffs[0].hint and "Adapt your script" in diffs[0].hint
    hyper = next(d for d in diffs if d.cause == "hyper")
    assert hyper.top == "optimizer" and "LR scheduler" in hyper.hint
    assert all(d.hint.startswith("follows from") for d in diffs if d.cause in ("value", "optimizer", "model"))
    # a plain value with nothing upstream is named as the cause
    c = _save(tmp_path / "c", ema=0.9, numpy_seed=1, bias=0.0)
    only = compare_checkpoints(a, c)
    explain(only)
    assert [d.top for d in only] == ["ema"] and "read it back from there after restore()" in only[0].hint
    # per stream: only NumPy's state is dropped
    assert "rng.numpy" not in {d.top for d in compare_checkpoints(a, b, ("rng.numpy",))}
    assert {d.top for d in compare_checkpoints(a, b, ("rng",))} == {"ema", "scheduler", "optimizer", "model"}


def test_a_stream_that_differed_at_the_first_checkpoint_is_never_seeded(tmp_path: Path) -> None:
    a = _save(tmp_path / "a", ema=0.5, numpy_seed=1, bias=0.0)
    b = _save(tmp_path / "b", ema=0.5, numpy_seed=2, bias=0.0)
    diffs = compare_checkpoints(a, b)
    explain(diffs, unseeded={"rng.numpy"})
    assert [d.top for d in diffs] == ["rng.numpy"] and diffs[0].hint.startswith("never seeded")
    assert culprits(diffs) == []


def test_an_explicit_root_that_overrides_the_launchers_warns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("SLURMRESUME_CKPT_DIR", str(tmp_path / "launcher"))
    Checkpointer(tmp_path / "mine", handle_signals=False).close()
    text = " ".join(r.getMessage() for r in caplog.records)
    assert str(tmp_path / "mine") in text and str(tmp_path / "launcher") in text and "overrides" in text
    events = [json.loads(x) for x in (tmp_path / "launcher" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "root_conflict" and events[-1]["script_root"] == str(tmp_path / "mine")


def drill(tmp_path: Path, case: str, *opts: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(SCRIPT), "--workdir", str(tmp_path / "w"),
                           "--preemptions", "1", "--seed", "3", *opts, "--", "--steps", "12", "--case", case,
                           *(["--root", str(tmp_path / "mine")] if case == "own-root" else [])],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**os.environ, "COLUMNS": "400"})


def _verdict(res: subprocess.CompletedProcess) -> dict:
    return json.loads(res.stdout[res.stdout.index("{"):])


# With --exhaustive only: test_drill_hermetic runs this very drill (the same script, case, seed and
# steps, a mirror configured) and asserts the same verdict besides its own
@pytest.mark.slow
@pytest.mark.exhaustive
def test_drill_passes_a_script_that_never_seeds_python_and_numpy(tmp_path: Path) -> None:
    res = drill(tmp_path, "unseeded", "--json")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    verdict = _verdict(res)
    assert verdict["ok"] is True
    noted = {d["key"] for d in verdict["differences"]}
    assert {"rng.python", "rng.numpy"} <= noted  # reported, not failed
    assert all(d["hint"].startswith("never seeded") and not d["culprit"] for d in verdict["differences"])


@pytest.mark.slow
def test_drill_names_a_plain_value_before_what_it_feeds(tmp_path: Path) -> None:
    res = drill(tmp_path, "local-ema", "--ignore", "rng.python", "--ignore", "rng.numpy")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    fails = [line for line in res.stdout.splitlines() if line.startswith("FAIL")]
    assert "ema state differs" in fails[0] and "read it back from there after restore()" in fails[0]
    assert any("optimizer state" in f for f in fails) and any("model state" in f for f in fails)  # every key
    assert "more differences" not in res.stdout  # no "... and N more" hiding a key
    assert "rng." not in res.stdout.split("FAIL", 1)[1]  # ignored per stream


@pytest.mark.slow
def test_drill_says_the_script_overrides_its_root(tmp_path: Path) -> None:
    res = drill(tmp_path, "own-root")
    assert res.returncode == 1
    out = res.stdout + res.stderr
    assert str(tmp_path / "mine") in out and "overrides the launcher's" in out and "Traceback" not in out

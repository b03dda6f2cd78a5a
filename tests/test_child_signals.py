"""Children of a rank and the signals: no child can die of the warning signal (forked or
exec'd: the mask is blocked, and a blocked mask survives exec), and a forked child gets the
previous handlers back, so SIGTERM stops it (`Process.terminate()`, `with Pool()` shutdown)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from helpers.procs import clean_env, run_python

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
@pytest.mark.parametrize("how", ["process", "torchrun-rank"])
def test_forked_and_spawned_children_of_a_checkpointing_process(tmp_path: Path, how: str) -> None:
    """`how`: a plain process, or a rank started by torchrun (its own session, the warning
    ignored by the agent before it installs its handler)."""
    helper = [HERE / "helpers" / "fork_children.py", tmp_path / "ck"]
    if how == "torchrun-rank":
        helper = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "--max-restarts=0", *helper]
    try:
        res = run_python(helper, env=clean_env(), timeout=240)
    except subprocess.TimeoutExpired as exc:  # the old code: `with Pool()` hangs forever at exit
        raise AssertionError(f"hung: {exc.stdout!r} {exc.stderr!r}") from None
    assert res.returncode == 0, res.stderr[-3000:]
    found = json.loads(res.stdout.strip().splitlines()[-1])
    assert found["pool"] == [0, 1, 4, 9] and found["pool_exit_s"] < 30
    assert found["terminate_exitcode"] == -signal.SIGTERM  # a forked child stops on SIGTERM again
    for method in ("fork", "spawn"):  # a warning to the child itself does not kill it
        assert found[f"{method}_warned_exitcode"] == 0, found
        assert found[f"{method}_blocked"] is True, found
    assert found["parent_flag"] == 2  # PREEMPT: the rank still acts on its own warning
    assert found["mask_after_close"] is False  # close() gives the mask back

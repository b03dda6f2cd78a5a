"""Lightning with `SlurmResume`: the drill passes bitwise through the real launcher and torchrun
with 1 and 2 ranks, and Lightning's own SLURM signal handling does not also act."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.integrations import drill as run_drill
from helpers.integrations import events, fake_scontrol, offline_env
from helpers.procs import HELPERS

pytest.importorskip("lightning")

SLURM_VARS = {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "train",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NNODES": "1",
              "SLURM_NODELIST": "localhost",
              # a real job's environment names its cluster: the lease records it (#27) without
              # asking `scontrol show config`, so the fake scontrol below stays uncalled
              "SLURM_CLUSTER_NAME": "testcluster"}


def _signal_when_ready(tmp_path: Path, env: dict[str, str], ours: bool, sig: signal.Signals,
                      done: Callable[[], bool] | None = None) -> tuple[int, str]:
    """Run helpers/lightning_slurm.py (400 steps), send `sig` once it is training, and return its
    exit code and output. `done`: stop waiting (and kill it) as soon as this holds (Lightning
    alone goes on training after its `scontrol requeue`, which is fake here)."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(HELPERS / "lightning_slurm.py"), str(tmp_path / "ckpt"), "400",
                             "1" if ours else "0", str(ready)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), proc.communicate(timeout=60)[0][-3000:]
        proc.send_signal(sig)
        deadline = time.monotonic() + 240
        while done is not None and proc.poll() is None and not done() and time.monotonic() < deadline:
            time.sleep(0.1)
        if done is not None and proc.poll() is None:
            proc.kill()
        out = proc.communicate(timeout=240)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, out


# Seed 85 plans warnings at steps 7 and 23 of 24. One rank has 8 batches per epoch (mid-epoch
# saves); two ranks have 4, and their agreed saves land one step later, at 8 and 24: the last
# batch of an epoch, the case Lightning's own restart miscounted. Both points run with
# `bash scripts/test --exhaustive`: test_ddp_frameworks::test_lightning_ddp_on_3_ranks_passes_the_drill
# runs the same command on 3 ranks (2 batches per epoch: the saves at 8 and 24 end epochs too);
# test_lightning_hooks.py drills the same callback on 1 and 2 ranks; this example on 1 rank
# resumes bitwise under real Slurm in test_integrations_slurm.py.
@pytest.mark.slow
@pytest.mark.parametrize("nproc", [pytest.param(1, marks=pytest.mark.exhaustive),
                                   pytest.param(2, marks=pytest.mark.exhaustive)])
def test_drill_passes_bitwise_on_the_lightning_example(tmp_path: Path, nproc: int) -> None:
    verdict = run_drill(tmp_path, "lightning_train.py", nproc, "--steps", "24", "--batch-size", "8")
    assert verdict["returncode"] == 0 and verdict["ok"] is True, (verdict["differences"][:5], verdict["stderr"])
    assert verdict["differences"] == [] and verdict["preemptions"] == 2 and verdict["missed"] == 0
    assert verdict["saved_steps"] == ([7, 23] if nproc == 1 else [8, 24])


@pytest.mark.slow
@pytest.mark.parametrize("ours", [True, False], ids=["with-slurmresume", "lightning-alone"])
def test_lightning_slurm_handler_does_not_act(tmp_path: Path, ours: bool) -> None:
    """Under SLURMEnvironment(auto_requeue=True), SIGUSR1 makes Lightning alone save an
    hpc_ckpt and run `scontrol requeue` from its handler (the control case, proving the test sees
    it). With SlurmResume: slurmresume's save at a step boundary and exit 75, no Lightning
    checkpoint, no scontrol call."""
    bindir, log = fake_scontrol(tmp_path)
    env = offline_env(**SLURM_VARS, PATH=f"{bindir}:{offline_env()['PATH']}")
    requeued = None if ours else (lambda: log.exists() and "requeue 4242" in log.read_text())
    returncode, out = _signal_when_ready(tmp_path, env, ours, signal.SIGUSR1, requeued)
    hpc = list((tmp_path / "lightning_root").glob("hpc_ckpt_*.ckpt")) if (tmp_path / "lightning_root").exists() \
        else []
    if not ours:
        assert log.exists() and "requeue 4242" in log.read_text(), out[-3000:]
        assert hpc, out[-3000:]
        return
    assert returncode == 75, out[-3000:]  # EXIT_PREEMPTED: saved, for the launcher to requeue
    assert not log.exists(), log.read_text()
    assert hpc == []
    saved = [e for e in events(tmp_path / "ckpt") if e["event"] == "exit_after_save"]
    assert len(saved) == 1 and (tmp_path / "ckpt" / f"step_{saved[0]['step']:09d}" / "COMMITTED").exists()
    assert "finished" not in out


@pytest.mark.slow
def test_lightning_sigterm_handler_is_not_installed(tmp_path: Path) -> None:
    """Lightning's SIGTERM handler would run next to ours (it composes with an existing one) and,
    with several ranks, broadcast from inside the handler. With SlurmResume it is not installed:
    SIGTERM is slurmresume's best-effort save and exit 76, and Lightning never logs it."""
    returncode, out = _signal_when_ready(tmp_path, offline_env(**SLURM_VARS), True, signal.SIGTERM)
    assert returncode == 76, out[-3000:]  # EXIT_TERMINATED
    assert "Received SIGTERM" not in out and "Bypassing SIGTERM" not in out, out[-3000:]
    saved = [e for e in events(tmp_path / "ckpt") if e["event"] == "exit_after_save"]
    assert len(saved) == 1 and saved[0]["kind"] == "terminate"

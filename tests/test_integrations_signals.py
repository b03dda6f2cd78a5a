"""A SIGUSR1 sent to every process of a run (launcher, torchrun agent, ranks: the process tree
walked from the launcher, as Slurm's proctrack/linuxproc delivers it) is handled: one agreed
save, one restart that resumes at the saved step, the run finishes, no process is left."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.integrations import (
    EXAMPLES,
    events,
    fake_scontrol,
    offline_env,
    signal_tree,
)


# Lightning's point with --exhaustive: the default lane sends the same SIGUSR1 to every process of
# a Lightning run on real Slurm (test_integrations_slurm: `scancel --signal=USR1`, one requeue,
# resumed at the saved step, bitwise); Lightning's own handlers: test_integrations_lightning.
@pytest.mark.slow
@pytest.mark.parametrize("script", [pytest.param("lightning_train.py", marks=pytest.mark.exhaustive),
                                    "hf_trainer_train.py"])
def test_sigusr1_to_every_process_saves_and_resumes(tmp_path: Path, script: str) -> None:
    pytest.importorskip("lightning" if script.startswith("lightning") else "transformers")
    root, steps = tmp_path / "ckpt", 30
    bindir, log = fake_scontrol(tmp_path)
    env = offline_env(PATH=f"{bindir}:{offline_env()['PATH']}")
    proc = subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", "--local", str(EXAMPLES / script),
                             "--ckpt-dir", str(root), "--nproc-per-node", "2", "--", "--steps", str(steps),
                             "--save-every", "2", "--batch-size", "8", "--step-sleep", "0.3"],
                            env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not (root / "step_000000002" / "COMMITTED").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.1)
        assert (root / "step_000000002" / "COMMITTED").exists(), "training never reached step 2"
        pids = signal_tree(proc.pid, signal.SIGUSR1)
        assert len(pids) >= 4  # launcher, torchrun agent, two ranks
        out = proc.communicate(timeout=600)[0]
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    ev = events(root)
    saves = [e for e in ev if e["event"] == "exit_after_save"]
    assert len(saves) == 1, out[-3000:]
    saved = saves[0]["step"]
    assert 2 <= saved < steps and (root / f"step_{saved:09d}" / "COMMITTED").exists()
    assert [e["event"] for e in ev].count("requeued") == 1
    assert [e["step"] for e in ev if e["event"] == "restored"][-1] == saved  # no lost step
    assert (root / f"step_{steps:09d}" / "COMMITTED").exists()
    assert not log.exists()  # nobody ran scontrol (local mode; Lightning's handler is off)
    assert not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))
    for p in pids:  # nothing of the run is left
        assert not Path(f"/proc/{p}").exists() or Path(f"/proc/{p}/status").read_text().find("zombie") >= 0

"""The launcher and the signal path, with real torchrun processes on this machine (local mode).

Delivery models: cgroup-like (the signal reaches only the launcher) and linuxproc-like (every
process of the tree, ranks and DataLoader workers included, found by walking /proc: torchrun
starts each rank in its own session, so a process-group signal would never reach them). Each must end in exactly one
save, one restart, a finished run, and no process left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers.core import shard_rows
from helpers.procs import alive_for_root, signal_tree

HELPERS = Path(__file__).parent / "helpers"
SIG_TRAIN = HELPERS / "sig_train.py"


def events(root: Path) -> list[dict]:
    path = root / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for(pred, timeout: float = 90.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def progress(piddir: Path, rank: int = 0) -> int:
    try:
        return int((piddir / f"progress{rank}").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def start_local(tmp_path: Path, nproc: int, steps: int, sleep: float = 0.05, workers: int = 0,
                extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, Path, Path]:
    root, piddir = tmp_path / "ckpt", tmp_path / "pids"
    piddir.mkdir()
    env = {**os.environ, "PIDDIR": str(piddir)}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmresume", "submit", "--local", str(SIG_TRAIN), "--ckpt-dir", str(root),
         "--nproc-per-node", str(nproc), *extra, "--", str(steps), str(sleep), str(workers)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, root, piddir


def signal_when(proc: subprocess.Popen, ready, send, what: str, timeout: float = 180) -> str:
    """Wait for `ready()`, call `send()`, then wait for the launcher to exit; returns its output.
    The whole process tree is killed if anything goes wrong."""
    try:
        wait_for(ready, what=what)
        send()
        out, _ = proc.communicate(timeout=timeout)
        return out
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)


def signalled_workers(piddir: Path, hit: list[int]) -> list[int]:
    """The DataLoader worker pids of the ranks that were signalled (sig_train.py writes them to
    workers<rank>-<rank pid>; the restarted run's ranks write their own)."""
    return [int(w) for p in piddir.glob("workers*") if int(p.name.rsplit("-", 1)[1]) in hit
            for w in p.read_text().split()]


# process-tree with --exhaustive: the default lane delivers to the whole tree of a 2-rank run in
# test_every_process_gets_the_warning_with_spawned_workers[forkserver] (one save, both ranks
# restart at the saved step, finished; its DataLoader workers hit too) and in
# test_integrations_signals (one requeue, nothing of the run left)
@pytest.mark.slow
@pytest.mark.parametrize("delivery", ["launcher-only", pytest.param("process-tree", marks=pytest.mark.exhaustive)])
def test_one_save_one_restart_per_warning(tmp_path: Path, delivery: str) -> None:
    proc, root, piddir = start_local(tmp_path, nproc=2, steps=60)
    # launcher-only: what Slurm does under proctrack/cgroup; process-group: linuxproc, where
    # every process hears it and the workers are told twice
    send = os.kill if delivery == "launcher-only" else signal_tree
    out = signal_when(proc, lambda: progress(piddir) >= 5, lambda: send(proc.pid, signal.SIGUSR1),
                      "training to reach step 5")
    assert proc.returncode == 0, out
    ev = events(root)
    saves = [e for e in ev if e["event"] == "exit_after_save"]
    assert len(saves) == 1, out
    saved = saves[0]["step"]
    assert [e["event"] for e in ev].count("requeued") == 1
    assert (root / f"step_{saved:09d}" / "COMMITTED").exists()
    # the restarted run (restart 1) resumed exactly at the saved step, on both ranks
    starts = sorted(piddir.glob("start*"))
    assert sorted(int(p.read_text()) for p in starts) == [0, 0, saved, saved]
    assert any(e["event"] == "finished" and e["step"] == 60 for e in ev)
    assert alive_for_root(str(SIG_TRAIN), root) == []


@pytest.mark.slow
def test_signal_to_one_rank_saves_same_step_on_both(tmp_path: Path) -> None:
    """Only rank 1 hears the signal: the MAX agreement makes both ranks save one step, once."""
    root, piddir = tmp_path / "ckpt", tmp_path / "pids"
    piddir.mkdir()
    env = {**os.environ, "PIDDIR": str(piddir), "SLURMRESUME_CKPT_DIR": str(root)}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             str(SIG_TRAIN), "200", "0.05"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = signal_when(proc, lambda: progress(piddir, 1) >= 3,
                      lambda: os.kill(int((piddir / "rank1.pid").read_text()), signal.SIGUSR1),
                      "rank 1 to reach step 3")
    ev = events(root)
    agreed = [e for e in ev if e["event"] == "signal_agreed"]
    commits = [e for e in ev if e["event"] == "save_committed"]
    assert len(agreed) == 1 and len(commits) == 1, out
    step = commits[0]["step"]
    manifest = json.loads((root / f"step_{step:09d}" / "manifest.json").read_text())
    assert manifest["world_size"] == 2 and [s["rank"] for s in shard_rows(manifest)] == [0, 1]
    assert progress(piddir, 0) == progress(piddir, 1) == step  # both stopped right at the agreed step
    assert step < 200


@pytest.mark.slow
def test_dataloader_workers_survive_tree_signal(tmp_path: Path) -> None:
    """num_workers=2 when every process of the tree gets the warning: workers neither die nor
    swallow it."""
    proc, root, piddir = start_local(tmp_path, nproc=1, steps=40, workers=2)
    hit: list[int] = []
    out = signal_when(proc, lambda: progress(piddir) >= 5 and any(piddir.glob("workers0-*")),
                      lambda: hit.extend(signal_tree(proc.pid, signal.SIGUSR1)), "training to reach step 5")
    assert proc.returncode == 0, out
    workers = signalled_workers(piddir, hit)
    assert len(workers) == 2 and set(workers) <= set(hit), (workers, hit)
    ev = events(root)
    assert [e["event"] for e in ev].count("exit_after_save") == 1
    assert not any(e["event"] == "failed" for e in ev), out
    assert any(e["event"] == "finished" for e in ev)
    assert "DataLoader worker" not in out


@pytest.mark.slow
# spawn and forkserver both start workers by exec, with no inherited handler; forkserver runs in the
# suite, spawn with `bash scripts/test --exhaustive` (tests/test_augment.py drills spawn workers too).
@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.exhaustive), "forkserver"])
def test_every_process_gets_the_warning_with_spawned_workers(tmp_path: Path, method: str) -> None:
    """linuxproc-like delivery to the whole tree, DataLoader workers started by spawn/forkserver
    with no worker_init_fn: they start with the warning at its default action unless it is
    blocked (a Python handler does not survive exec). The run saves once, restarts, resumes at
    the saved step, and finishes; no worker died."""
    proc, root, piddir = _start_with_method(tmp_path / "run", method)
    hit: list[int] = []
    out = signal_when(proc, lambda: progress(piddir) >= 5 and len(list(piddir.glob("workers*"))) >= 2,
                      lambda: hit.extend(signal_tree(proc.pid, signal.SIGUSR1)), "workers and step 5", timeout=300)
    assert proc.returncode == 0, out
    workers = signalled_workers(piddir, hit)
    assert len(workers) == 4 and set(workers) <= set(hit), (workers, hit)
    ev = events(root)
    saves = [e for e in ev if e["event"] == "exit_after_save"]
    assert len(saves) == 1 and saves[0]["kind"] == "preempt", out
    assert sorted(int(p.read_text()) for p in piddir.glob("start*")) == [0, 0, saves[0]["step"], saves[0]["step"]]
    assert any(e["event"] == "finished" and e["step"] == 30 for e in ev), out
    assert not any(e["event"] == "failed" for e in ev), out
    assert "DataLoader worker" not in out and "killed by signal" not in out, out


def _start_with_method(tmp_path: Path, method: str) -> tuple[subprocess.Popen, Path, Path]:
    tmp_path.mkdir()
    root, piddir = tmp_path / "ckpt", tmp_path / "pids"
    piddir.mkdir()
    env = {**os.environ, "PIDDIR": str(piddir)}
    env.pop("SLURM_JOB_ID", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmresume", "submit", "--local", str(SIG_TRAIN), "--ckpt-dir", str(root),
         "--nproc-per-node", "2", "--", "30", "0.1", "2", method],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, root, piddir


def test_handlers_installed_in_main_thread_only_and_restored(tmp_path: Path) -> None:
    import slurmresume

    before_usr1, before_term = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    ck = slurmresume.Checkpointer(tmp_path)
    assert signal.getsignal(signal.SIGUSR1) not in (before_usr1, signal.SIG_DFL)
    ck.close()
    assert signal.getsignal(signal.SIGUSR1) == before_usr1
    assert signal.getsignal(signal.SIGTERM) == before_term

    made: list = []
    t = threading.Thread(target=lambda: made.append(slurmresume.Checkpointer(tmp_path)))
    t.start()
    t.join()
    assert made[0].flag is None  # not installed off the main thread
    assert signal.getsignal(signal.SIGUSR1) == before_usr1


@pytest.mark.slow
def test_sigterm_saves_without_requeue(tmp_path: Path) -> None:
    proc, root, piddir = start_local(tmp_path, nproc=1, steps=200)
    out = signal_when(proc, lambda: progress(piddir) >= 4, lambda: os.kill(proc.pid, signal.SIGTERM),
                      "training to reach step 4")
    ev = events(root)
    exits = [e for e in ev if e["event"] == "exit_after_save"]
    assert len(exits) == 1 and exits[0]["kind"] == "terminate", out
    assert not any(e["event"] == "requeued" for e in ev)
    assert any(e["event"] == "stopped" for e in ev)
    assert (root / f"step_{exits[0]['step']:09d}" / "COMMITTED").exists()


# decide() is tested with a table in tests/test_lifecycle.py (it reads the contract's outcome).


@pytest.mark.slow
def test_max_failures_retries_a_crash(tmp_path: Path) -> None:
    """A crash without a signal is retried from the newest checkpoint, at most --max-failures."""
    script = tmp_path / "crash.py"
    script.write_text("import sys, slurmresume\nc = slurmresume.Checkpointer()\nsys.exit(3)\n")
    root = tmp_path / "ckpt"
    proc = subprocess.run([sys.executable, "-m", "slurmresume", "submit", "--local", str(script),
                           "--ckpt-dir", str(root), "--max-failures", "2"], capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    ev = events(root)
    assert [e["event"] for e in ev].count("started") == 3
    assert [e["event"] for e in ev][-1] in ("failed", "gave_up")
    assert any(e["event"] == "gave_up" and "--max-failures 2" in e["reason"] for e in ev)

"""A newcomer's first hour (issue 31): what `submit` and `drill` refuse before anything is queued
or written, and the one honest line each failure ends with. Like tests/test_user_errors.py:
the exact command through the real `python -m slurmresume`, one `error:` line, the exit code,
nothing written. A fake `sbatch`/`srun` on PATH answers "Submitted batch job 4242", so a
refusal that did not happen shows as exit 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.core import tiny_state
from helpers.procs import REPO, clean_env
from helpers.slurm_fakes import fake_slurm

from slurmresume import Checkpointer

SCRIPT = REPO / "examples" / "train.py"
GOOD = "import slurmresume\nckpt = slurmresume.Checkpointer()\nstep = ckpt.restore({})\nfor i in range(3):\n    ckpt.step(i, {})\n"


def cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env(**{"PYTHONPATH": str(REPO), "COLUMNS": "200", "NO_COLOR": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "slurmresume", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def script(tmp: Path, body: str, name: str = "train.py") -> str:
    (tmp / name).write_text(body)
    return str(tmp / name)


def saved_root(root: Path, *steps: int) -> Path:
    ckpt = Checkpointer(root, handle_signals=False)
    for s in steps:
        ckpt.save(s, tiny_state(s))
    ckpt.close()
    return root


def no_boto3(tmp: Path) -> dict[str, str]:
    """An environment whose python cannot import boto3 (a sitecustomize blocks it)."""
    d = tmp / "site"
    d.mkdir()
    (d / "sitecustomize.py").write_text("import sys\nsys.modules['boto3'] = None\n")
    return {"PYTHONPATH": f"{d}:{REPO}"}


SHM = Path("/dev/shm")


@dataclass
class Row:
    id: str
    setup: Callable[[Path], list[str]]  # -> argv, after preparing files under tmp_path
    message: str  # a fragment of the one error line
    code: int = 1
    env: Callable[[Path], dict[str, str]] | None = None


ROWS = [
    Row("script with a syntax error",
        lambda t: ["submit", script(t, "def f(:\n    pass\n"), "--ckpt-dir", str(t / "ck")],
        "train.py does not parse: line 1"),
    Row("script with a syntax error, --local",
        lambda t: ["submit", script(t, "def f(:\n    pass\n"), "--local", "--ckpt-dir", str(t / "ck")],
        "train.py does not parse: line 1"),
    Row("drill a script with a syntax error",
        lambda t: ["drill", script(t, "x = (\n"), "--workdir", str(t / "d")], "train.py does not parse"),
    Row("script never calls restore()",
        lambda t: ["submit", script(t, GOOD.replace("step = ckpt.restore({})\n", "")), "--ckpt-dir", str(t / "ck")],
        "never calls .restore(state)"),
    Row("script never calls ckpt.step()",
        lambda t: ["submit", script(t, GOOD.replace("    ckpt.step(i, {})", "    pass")), "--dry-run",
                   "--ckpt-dir", str(t / "ck")], "never calls ckpt.step(...)"),
    Row("--mirror without boto3",
        lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--mirror", "s3://bkt/run1"],
        "--mirror s3://bkt/run1 needs boto3", env=no_boto3),
    Row("--signal KILL", lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--signal", "KILL"],
        "SIGKILL cannot be caught"),
    Row("--signal STOP", lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--signal", "SIGSTOP"],
        "SIGSTOP cannot be caught"),
    Row("--signal TERM", lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--signal", "TERM"],
        "TERM is what Slurm sends on scancel"),
    Row("--signal B:INT", lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--signal", "B:INT"],
        "torchrun's agent stops the workers on INT"),
    Row("--nodes 2 on /dev/shm",
        lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(SHM / f"sr-{t.name}-{uuid.uuid4().hex[:8]}" / "ck"),
                   "--nodes", "2"], "is on tmpfs (/dev/shm), which only one node sees"),
    Row("--nodes 2 on a local disk",
        lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--nodes", "2"], "pass --shared-root"),
    Row("--resume-from a missing step",
        lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(saved_root(t / "ck", 1, 2)), "--resume-from", "7"],
        "--resume-from 7:"),
    Row("--resume-from a missing step, --dry-run",
        lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(saved_root(t / "ck", 1)), "--resume-from", "7",
                   "--dry-run"], "step_000000007 does not exist"),
    Row("--branch into a non-empty directory, --dry-run",
        lambda t: (((t / "full").mkdir(), (t / "full" / "x").write_text("x")),
                   ["submit", str(SCRIPT), "--ckpt-dir", str(saved_root(t / "ck", 1, 2)), "--resume-from", "1",
                    "--branch", str(t / "full"), "--dry-run"])[1], "exists and is not empty"),
]


ROWS += [
    Row("--setup with a newline",
        lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--setup", "module load x\nrm -rf ~"],
        "--setup contains a newline"),
    Row("--signal USR1@soon", lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--signal", "USR1@soon"],
        "SECONDS after @ must be a whole number"),
    Row("--signal USR1@300 with --signal-lead 120",
        lambda t: ["submit", str(SCRIPT), "--ckpt-dir", str(t / "ck"), "--signal", "USR1@300", "--signal-lead", "120"],
        "disagree"),
    Row("a script option before --", lambda t: ["submit", str(SCRIPT), "--steps", "3", "--ckpt-dir", str(t / "ck")],
        "script arguments go after `--`", code=2),
]


def _drill_folder(tmp: Path) -> Path:
    """A drill's --workdir: two roots side by side (what `slurmresume drill` leaves)."""
    work = tmp / "drill"
    for name in ("uninterrupted", "preempted"):
        saved_root(work / name, 1, 2)
    (work / ".slurmresume-drill").write_text("created by `slurmresume drill`")
    return work


STATUS_ROWS = [
    Row("status on a drill's folder", lambda t: ["status", "-d", str(_drill_folder(t))],
        "is not a checkpoint root but holds 2: slurmresume status -d "),
    Row("status on a step folder", lambda t: ["status", "-d", str(saved_root(t / "ck", 1, 2) / "step_000000002")],
        "is a step folder, not a checkpoint root: use its parent: slurmresume status -d "),
]


@pytest.mark.parametrize("row", STATUS_ROWS, ids=[r.id for r in STATUS_ROWS])
def test_status_knows_what_it_looks_at(row: Row, tmp_path: Path) -> None:
    args = row.setup(tmp_path)
    proc = cli(args, tmp_path)
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and row.message in lines[0], proc.stderr
    assert proc.stdout == ""


def test_status_of_a_fresh_empty_root_is_still_starting(tmp_path: Path) -> None:
    (tmp_path / "ck").mkdir()
    proc = cli(["status", "-d", str(tmp_path / "ck"), "--json"], tmp_path, {"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr


def _shm_roots() -> set[str]:
    return {p.name for p in SHM.iterdir() if p.name.startswith("sr-")} if SHM.is_dir() else set()


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_refused_before_the_queue(row: Row, tmp_path: Path) -> None:
    if "/dev/shm" in row.id and not SHM.is_dir():
        pytest.skip("no /dev/shm")
    bindir = fake_slurm(tmp_path)
    args = row.setup(tmp_path)
    env = {"PATH": f"{bindir}"}
    if row.env:
        env.update(row.env(tmp_path))
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    shm_before = _shm_roots()
    proc = cli(args, tmp_path, env)
    assert proc.returncode == row.code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert row.message in lines[0], lines[0]
    assert "4242" not in proc.stdout  # nothing was queued
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before  # nothing written, no logs/ either
    assert _shm_roots() == shm_before


def test_the_overrides_submit(tmp_path: Path) -> None:
    """--no-script-check and --shared-root are the ways past the two refusals that can be wrong
    (a script whose loop lives in a module it imports; a cluster mounting one local path everywhere)."""
    bindir = fake_slurm(tmp_path)
    thin = script(tmp_path, "from mypkg.train import main\nmain()\n")
    proc = cli(["submit", thin, "--ckpt-dir", str(tmp_path / "ck"), "--no-script-check", "--nodes", "2",
                "--shared-root", "--dry-run"], tmp_path, {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=2" in proc.stdout


def test_a_local_run_of_a_script_that_never_restores_is_warned_not_refused(tmp_path: Path) -> None:
    body = "import slurmresume\nckpt = slurmresume.Checkpointer()\nfor i in range(1, 3):\n    ckpt.step(i, {'i': i})\n"
    proc = cli(["submit", script(tmp_path, body), "--local", "--ckpt-dir", str(tmp_path / "ck")], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "warning: train.py never calls .restore(state)" in proc.stderr


def _progress(piddir: Path) -> int:
    p = piddir / "progress0"
    try:
        return int(p.read_text() or 0)
    except (OSError, ValueError):
        return 0


def test_ctrl_c_of_a_local_run_says_where_it_stopped_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's process group) of `submit --local`: the ranks save, the
    last line names the step and the checkpoint, exit 130, so `submit --local && next` stops."""
    import signal

    from helpers.procs import signal_tree

    root, piddir = tmp_path / "ck", tmp_path / "pids"
    piddir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", "--local",
                             str(REPO / "tests" / "helpers" / "sig_train.py"), "--ckpt-dir", str(root), "--", "400",
                             "0.05"], env=clean_env(PYTHONPATH=str(REPO), PIDDIR=str(piddir)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _progress(piddir) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, "training never reached step 3"
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    step = int(last.split("interrupted at step ")[1].split()[0])
    assert last == f"interrupted at step {step} (checkpoint step {step}): the same command resumes from there"
    assert (root / f"step_{step:09d}" / "COMMITTED").exists() and step >= 3


def test_sbatch_without_srun_is_one_line_and_leaves_no_logs(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path, srun=False)
    root = tmp_path / "ck"
    proc = cli(["submit", str(SCRIPT), "--ckpt-dir", str(root)], tmp_path, {"PATH": str(bindir)})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip() == ("error: sbatch is on PATH but srun is not: submit from a Slurm login node (where "
                                   "both are), or use --local to run here")
    assert not root.exists()  # no <ckpt-dir>/logs/ either


def test_a_script_that_raises_at_import_ends_with_its_traceback_and_one_line_of_ours(tmp_path: Path) -> None:
    bad = script(tmp_path, "import slurmresume\nraise ValueError('bad config')\n", name="bad.py")
    proc = cli(["submit", bad, "--local", "--ckpt-dir", str(tmp_path / "ck")], tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert "ValueError: bad config" in lines  # the user's traceback stays: it is theirs
    assert "ChildFailedError" not in proc.stderr and "torch/distributed/run.py" not in proc.stderr
    # carry on by default (issue 47): retried once in the allocation, then the crash-loop rule stops it
    assert lines[-1] == ("slurmresume: giving up: workers failed (exit 1), twice in a row with no new committed step "
                         "(newest: none): crash loop; the script's error is above; fix it and run the same command "
                         "(it resumes from the newest checkpoint)")
    assert lines.count("ValueError: bad config") == 2  # the first run and its one retry
    last = len(lines) - 1 - lines[::-1].index("ValueError: bad config")
    assert last >= len(lines) - 4  # at most torch's one log line between


def test_submit_speaks_sbatch(tmp_path: Path) -> None:
    """-N -p -t -A -q -C -J, --gres, --signal SIG@SECONDS and --setup, as sbatch users type them;
    no `#SBATCH --wckey` nobody asked for; --setup lines run before the launcher's srun."""
    bindir = fake_slurm(tmp_path)
    proc = cli(["submit", str(SCRIPT), "-N", "2", "-p", "gpu", "-t", "1:00:00", "-A", "proj", "-q", "high", "-C", "a100",
                "-J", "run1", "--gres", "gpu:4", "--signal", "USR2@300", "--setup", "module load cuda/12.4",
                "--setup", "source ~/venv/bin/activate", "--ckpt-dir", str(tmp_path / "ck"), "--dry-run", "--",
                "--steps", "3"], tmp_path, {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for want in ("#SBATCH --nodes=2", "#SBATCH --partition=gpu", "#SBATCH --time=60", "#SBATCH --account=proj",
                 "#SBATCH --qos=high", "#SBATCH --constraint=a100", "#SBATCH --job-name=run1", "#SBATCH --gres=gpu:4",
                 "#SBATCH --signal=USR2@300"):
        assert want in lines, want
    assert not any("wckey" in line for line in lines)
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert lines.index("module load cuda/12.4") < lines.index("source ~/venv/bin/activate") < srun
    assert "trap 'kill -s USR2 $SLURMRESUME_SRUN 2>/dev/null' USR2" in lines
    assert not (tmp_path / "ck").exists()


def test_version() -> None:
    from slurmresume import __version__

    proc = cli(["--version"], REPO)
    assert proc.returncode == 0 and proc.stdout.strip() == f"slurmresume {__version__}", proc.stderr


def test_a_job_slurm_does_not_know_is_unknown_not_healthy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """squeue and sacct answer nothing for the log's job (another cluster, purged accounting):
    the headline says UNKNOWN and exits 5, never HEALTHY running."""
    import json

    from typer.testing import CliRunner

    from slurmresume.cli import app
    from slurmresume.events import append_event
    from slurmresume.tools import status
    from slurmresume.tools.health import EXIT_UNKNOWN

    def slurm(args: list[str], timeout: float = 10.0) -> str:
        return "slurm 22.05.8\n" if "--version" in args else ""

    monkeypatch.setattr(status, "run_slurm", slurm)
    root = saved_root(tmp_path / "ck", 1, 2)
    append_event(root, "submitted", job="4242", job_id="4242")
    append_event(root, "started", restart=0)
    res = CliRunner().invoke(app, ["status", "-d", str(root), "--json"], env={"COLUMNS": "120", "NO_COLOR": "1"})
    verdict = json.loads(res.stdout)["verdict"]
    assert res.exit_code == EXIT_UNKNOWN and verdict["verdict"] == "unknown", res.stdout
    assert "Slurm knows no job 4242" in verdict["reason"]


def test_prune_into_a_pipe_refuses_instead_of_prompting_unseen(tmp_path: Path) -> None:
    """`prune --keep 1 | tail` from a terminal: stdin is a terminal, stdout is not, so nobody sees
    the question; refuse with the --yes hint instead of waiting forever. Nothing deleted."""
    root = saved_root(tmp_path / "ck", 1, 2, 3)
    leader, follower = os.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "slurmresume", "prune", "--keep", "1", "-d", str(root)],
                              stdin=follower, capture_output=True, text=True, timeout=60,
                              env=clean_env(PYTHONPATH=str(REPO), COLUMNS="200", NO_COLOR="1"))
    finally:
        os.close(leader)
        os.close(follower)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: refusing to delete 2 entries without confirmation: "
                                                           "pass --yes")
    assert all((root / f"step_{s:09d}" / "COMMITTED").exists() for s in (1, 2, 3))


def test_status_watch_into_a_pipe_prints_each_snapshot_as_it_comes(tmp_path: Path) -> None:
    """`status --watch 1 | tee`: the first snapshot arrives while the watch runs (rich's Live
    printed nothing into a pipe until it exited, and nothing at all when killed by `timeout`)."""
    import select

    root = saved_root(tmp_path / "ck", 1)
    proc = subprocess.Popen([sys.executable, "-m", "slurmresume", "status", "-d", str(root), "--watch", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=clean_env(PYTHONPATH=str(REPO), COLUMNS="120", NO_COLOR="1", PATH="/usr/bin:/bin"))
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.poll() is None, "nothing printed while the watch runs"
        first = os.read(proc.stdout.fileno(), 65536).decode()
        assert "step_000000001" in first or " 1 " in first, first
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_watch_hint_after_submit_is_quoted_for_the_shell(tmp_path: Path) -> None:
    import shlex

    bindir = fake_slurm(tmp_path)
    root = tmp_path / "my runs" / "exp 1"
    proc = cli(["submit", str(SCRIPT), "--ckpt-dir", str(root)], tmp_path, {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    hint = next(line for line in proc.stdout.splitlines() if line.startswith("watch it:"))
    argv = shlex.split(hint.removeprefix("watch it:"))
    assert argv == ["slurmresume", "status", "--ckpt-dir", str(root), "--job", "4242"]


def test_verify_latest_works_like_inspect_latest(tmp_path: Path) -> None:
    root = saved_root(tmp_path / "ck", 1, 2)
    for cmd in (["verify", "latest"], ["inspect", "latest"]):
        proc = cli([*cmd, "-d", str(root)], tmp_path)
        assert proc.returncode == 0, (cmd, proc.stderr)
        assert "step_000000002" in proc.stdout or "step 2" in proc.stdout.lower(), (cmd, proc.stdout)
    assert "step_000000001" not in cli(["verify", "latest", "-d", str(root)], tmp_path).stdout


def test_torchruns_thread_count_banner_is_printed_once_per_job(tmp_path: Path) -> None:
    """Two processes per node and a crash retried once: two torchrun runs, one OMP_NUM_THREADS
    banner (the retry gets the same OMP_NUM_THREADS=1 torchrun set the first time, so torchrun has
    nothing to announce); the ranks run with 1 thread both times."""
    marker = tmp_path / "crashed"
    threads = tmp_path / "threads"
    body = ("import os, pathlib, sys\nimport torch.distributed as dist\nimport slurmresume\n"
            f"pathlib.Path({str(threads)!r}).open('a').write(os.environ.get('OMP_NUM_THREADS', '-') + '\\n')\n"
            "dist.init_process_group('gloo')\n"  # two ranks: without a process group they are refused (issue 46)
            "ckpt = slurmresume.Checkpointer()\nstep = ckpt.restore({})\n"
            f"m = pathlib.Path({str(marker)!r})\n"
            "if not m.exists() and os.environ['RANK'] == '0':\n    m.write_text('x')\n    sys.exit(3)\n"
            "for i in range(2):\n    ckpt.step(i, {})\n")
    env = clean_env(PYTHONPATH=str(REPO))
    del env["OMP_NUM_THREADS"]  # as a user's shell has it: unset, so torchrun sets (and announces) it
    proc = subprocess.run([sys.executable, "-m", "slurmresume", "submit", script(tmp_path, body), "--local",
                           "--nproc-per-node", "2", "--max-failures", "1", "--ckpt-dir", str(tmp_path / "ck")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert marker.exists()  # the first run did crash: there were two torchrun runs
    assert (proc.stdout + proc.stderr).count("Setting OMP_NUM_THREADS") == 1, proc.stderr[-3000:]
    assert threads.read_text().split() == ["1"] * 4  # 2 ranks x 2 runs, each with torchrun's 1 thread

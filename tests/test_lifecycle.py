"""The launcher's lifecycle with real processes and real signals (local mode, no Slurm): it decides
from the contract's outcome record (never the event log), a failed emergency save resumes from the
newest complete checkpoint, local restarts get a fresh failure budget, nothing outlives the
launcher, and a run that saved nothing says so. Pure parts (decide, the time-limit rule, the
requeue retry loop) are tested with tables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import clean_env

from slurmresume import slurm
from slurmresume.contract import LastRun, Outcome, read_last_run, write_last_run, write_outcome
from slurmresume.errors import SlurmError
from slurmresume.events import read_events
from slurmresume.job.guardian import start_time
from slurmresume.job.torchrun import RunResult, decide

HELPERS = Path(__file__).parent / "helpers"
LC_TRAIN = HELPERS / "lifecycle_train.py"


def events(root: Path) -> list[dict]:
    path = root / "events.jsonl"
    out = []
    if path.exists():
        for line in path.read_bytes().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("event") != "pad":
                out.append(rec)
    return out


def names(root: Path) -> list[str]:
    return [e["event"] for e in events(root)]


def submit_local(tmp_path: Path, steps: int, sleep: float = 0.05, *, extra: tuple[str, ...] = (),
                 script: Path = LC_TRAIN, **env: str) -> tuple[subprocess.Popen, Path, Path]:
    root, piddir = tmp_path / "ckpt", tmp_path / "pids"
    piddir.mkdir(exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "slurmresume", "submit", "--local", str(script), "--ckpt-dir", str(root), *extra,
         "--", str(steps), str(sleep)],
        env=clean_env(PIDDIR=str(piddir), PYTHONPATH=os.environ.get("PYTHONPATH", ""), **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return proc, root, piddir


def finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def wait_for(pred, timeout: float = 120.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def progress(piddir: Path) -> int:
    try:
        return int((piddir / "progress0").read_text() or 0)
    except (FileNotFoundError, ValueError):
        return 0


def committed(root: Path) -> list[int]:
    return sorted(int(p.parent.name.split("_")[1]) for p in root.glob("step_*/COMMITTED"))


# -- decide(): a table ---------------------------------------------------------------------------

def _r(rc: int = 0, outcome: tuple | None = None, before: int | None = 10, after: int | None = 20,
       warned: bool = False, stop: str | None = None, behind: tuple | None = None) -> RunResult:
    out = Outcome("r", *outcome) if outcome else None  # (kind, step, committed[, error])
    return RunResult(rc, out, before, after, warned=warned, stop=stop, mirror_behind=behind)


@pytest.mark.parametrize(
    ("result", "kw", "action", "says"),
    [
        (_r(), {}, "finish", "training finished"),
        (_r(before=None, after=None), {}, "finish", "no checkpoint"),
        (_r(outcome=("terminate", 20, True)), {}, "stop", "saved step 20"),
        (_r(outcome=("preempt", 20, True)), {}, "requeue", "preempted at step 20, committed"),
        (_r(outcome=("preempt", 20, True)), {"first_node": False}, "stop", "first node"),
        (_r(outcome=("preempt", 20, True)), {"requeues_done": 3, "max_requeues": 3}, "give_up", "--max-requeues 3"),
        (_r(outcome=("preempt", 20, True)), {"requeues_done": 99, "max_requeues": None}, "requeue", "committed"),
        (_r(outcome=("preempt", 20, True), before=20, after=20), {"previous_progressed": False}, "give_up",
         "crash loop"),
        (_r(outcome=("preempt", 20, True), before=20, after=20), {"previous_progressed": True}, "requeue", ""),
        # a failed emergency save: one rule, resume from the newest complete checkpoint
        (_r(1, ("preempt", 25, False, "ENOSPC"), after=20), {}, "requeue", "5 step(s) lost"),
        (_r(1, ("preempt", 25, False, "ENOSPC"), before=None, after=None), {}, "give_up", "no complete"),
        (_r(1, warned=True), {}, "requeue", "emergency save failed"),  # a crash, no record at all
        # a crash during the emergency save after a periodic commit of this run is NOT "committed"
        (_r(1, ("preempt", 20, False, "did not finish"), before=10, after=20), {}, "requeue", "failed"),
        (_r(0, warned=True, before=20, after=20), {}, "give_up", "saved nothing"),
        (_r(0, warned=True, before=10, after=30), {}, "finish", "training finished"),
        # SIGTERM: the time limit requeues from the newest complete; a cancel never does
        (_r(-9, stop="time_limit"), {}, "requeue", "time limit"),
        (_r(-9, stop="time_limit", before=None, after=None), {}, "give_up", "no complete"),
        (_r(0, ("preempt", 20, True), stop="cancel"), {}, "stop", "cancelled"),
        (_r(0, ("terminate", 20, True), stop="interrupt"), {}, "stop", "interrupted"),
        (_r(3), {"max_failures": 2, "failures_done": 1}, "retry", "retry 2 of 2"),
        (_r(3), {"max_failures": 2, "failures_done": 2}, "give_up", "--max-failures 2"),
        (_r(3), {}, "give_up", "the script's error is above"),  # no retry asked for: not "0 used up"
        # the default (no cap, issue 47): an unwarned failure resumes in the allocation while runs commit
        (_r(1), {"max_failures": None, "failures_done": 7}, "retry", "retry 8 in this allocation from the newest"),
        (_r(1, before=20, after=20), {"max_failures": None, "previous_progressed": None}, "retry", "step 20"),
        (_r(1, before=20, after=20), {"max_failures": None, "previous_progressed": False}, "give_up",
         "twice in a row with no new committed step (newest: still step 20): crash loop; the script's error"),
        (_r(1, before=None, after=None), {"max_failures": None, "previous_progressed": False}, "give_up",
         "(newest: none)"),
        (_r(1, before=20, after=21), {"max_failures": None, "previous_progressed": False}, "retry", "step 21"),
        # rank 0 exited 78 at close (torchrun says 1): finished locally, the bucket lacks the step;
        # a retry would train nothing: end with that reason, whatever the failure budget
        (_r(1, behind=(20, "server down")), {"max_failures": 2}, "behind", "step 20 is not on the mirror"),
        (_r(1, behind=(None, "deadline")), {}, "behind", "training finished at step 20"),
        (_r(1, behind=(20, "x"), before=None, after=None), {"max_failures": 2}, "retry", "retry 1 of 2"),
        (_r(1, ("preempt", 20, True), behind=(20, "x")), {}, "requeue", "preempted at step 20"),
    ],
)
def test_decide(result: RunResult, kw: dict, action: str, says: str) -> None:
    args = {"first_node": True, "requeues_done": 0, "max_requeues": 20, "failures_done": 0, "max_failures": 0,
            "previous_progressed": True, **kw}
    got, reason = decide(result, **args)
    assert (got, says in reason) == (action, True), reason


# -- the time-limit rule and the requeue retry loop: tables, no Slurm ------------------------------

@pytest.mark.parametrize(
    ("now_info", "end_at_start", "now", "expected"),
    [
        (slurm.JobTimes("COMPLETING", "TimeLimit", 60, 89), 1000.0, 0.0, True),
        (slurm.JobTimes("COMPLETING", "None", 300, 4), 1000.0, 2000.0, False),  # scancel, stale EndTime
        (slurm.JobTimes("RUNNING", "None", 60, 60), None, 0.0, True),
        (None, 1000.0, 1001.0, True),  # slurmctld silent: the EndTime read at start
        (None, 1000.0, 900.0, False),
        (None, None, 5.0, False),  # nothing known: a cancel (never undo a user's cancel)
    ],
)
def test_is_time_limit(now_info, end_at_start, now, expected) -> None:
    assert slurm.is_time_limit(now_info, end_at_start, now) is expected


def test_parse_show_job_and_kill_wait() -> None:
    info = slurm.parse_show_job("JobId=3 JobState=COMPLETING Reason=TimeLimit RunTime=00:01:29 "
                                "TimeLimit=1-00:01:00 EndTime=2026-12-03T10:29:19")
    assert (info.state, info.reason, info.run_time_s, info.time_limit_s) == ("COMPLETING", "TimeLimit", 89, 86460)
    assert info.end_time is not None
    assert slurm.parse_show_job("TimeLimit=UNLIMITED EndTime=Unknown").time_limit_s is None
    assert slurm.parse_kill_wait("JobRequeue = 1\nKillWait                = 5 sec\n") == 5.0


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_requeue_retries_then_succeeds_and_gives_up_at_the_deadline() -> None:
    clock, calls = FakeClock(), []

    def flaky(job: str, timeout: float) -> None:
        calls.append(timeout)
        clock.t += 0.1
        if len(calls) <= 2:
            raise SlurmError("slurm_requeue error: Socket timed out")

    errors = slurm.requeue_with_retry("7", lambda: 30.0, clock=clock, sleep=clock.sleep, attempt=flaky)
    assert len(errors) == 2 and len(calls) == 3
    assert all(t <= 30.0 for t in calls)

    clock, calls = FakeClock(), []

    def never(job: str, timeout: float) -> None:
        calls.append(timeout)
        clock.t += timeout  # a hung slurmctld: each attempt uses its whole timeout
        raise SlurmError("did not answer")

    with pytest.raises(SlurmError, match="failed"):
        slurm.requeue_with_retry("7", lambda: 20.0, clock=clock, sleep=clock.sleep, attempt=never)
    assert clock.t <= 20.0 + 1.0 and calls[0] <= 20.0


# -- the contract's records and the bounded event log --------------------------------------------

def test_records_round_trip_and_event_log_is_read_from_its_tail(tmp_path: Path) -> None:
    write_outcome(tmp_path, Outcome("job.0.0", "preempt", 5, True))
    write_last_run(tmp_path, LastRun("job", "job.0.0", "preempted", "requeue", True, 5, None))
    assert read_last_run(tmp_path, "job") == LastRun("job", "job.0.0", "preempted", "requeue", True, 5, None)
    assert read_last_run(tmp_path, "other") is None
    log = tmp_path / "events.jsonl"
    with log.open("wb") as f:
        f.write(b'{"event":"first"}\n' + b'{"event":"pad","x":"' + b"y" * (70 << 20) + b'"}\n')
        f.write(b'{"event":"last"}\n')
    assert [e["event"] for e in read_events(tmp_path)] == ["last"]


# -- real runs -----------------------------------------------------------------------------------

def _pad_event_log(root: Path, mib: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    line = b'{"event":"pad","time":0,"x":"' + b"z" * 4000 + b'"}\n'
    with (root / "events.jsonl").open("wb") as f:
        for _ in range((mib << 20) // len(line) + 1):
            f.write(line)


@pytest.mark.slow
def test_huge_event_log_changes_no_decision(tmp_path: Path) -> None:
    """70 MiB of history in events.jsonl: a warned run still saves, restarts and completes."""
    _pad_event_log(tmp_path / "ckpt", 70)
    proc, root, piddir = submit_local(tmp_path, 30, LC_WARN_AT="5")
    out = finish(proc)
    assert proc.returncode == 0, out
    ev = events(root)
    assert [e["event"] for e in ev].count("requeued") == 1, out
    ended = [e for e in ev if e["event"] == "run_ended"]
    assert [e["outcome"] for e in ended] == ["preempted", "finished"], out
    assert committed(root)[-1] == 30


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["crash", "error"])
def test_failed_emergency_save_resumes_from_newest_complete(tmp_path: Path, fault: str) -> None:
    """Periodic saves every 4 steps; the warning at step 5; the emergency save of step 5 (or 6)
    dies (crash) or fails (ENOSPC). Not "preempted, committed": a save_failed run whose lost steps
    are logged, requeued (locally: restarted) from step 4, finishing at 12."""
    proc, root, piddir = submit_local(tmp_path, 12, LC_SAVE_EVERY="4", LC_WARN_AT="5", LC_SAVE_FAULT=fault)
    out = finish(proc)
    assert proc.returncode == 0, out
    ev = events(root)
    ended = [e for e in ev if e["event"] == "run_ended"]
    assert ended[0]["outcome"] == "save_failed", out
    assert "committed" not in ended[0]["reason"] and ended[0]["action"] == "requeue"
    assert ended[0]["lost_steps"] is not None and ended[0]["lost_steps"] >= 1, ended[0]
    assert "exit_after_save" not in names(root)
    restored = [e["step"] for e in ev if e["event"] == "restored"]
    assert restored == [4], out
    assert ended[-1]["outcome"] == "finished" and committed(root)[-1] == 12
    # the launch's nonce, from the outcome record rank 0 wrote in the first run: the crash-loop
    # record the launcher left at the end belongs to the same launch
    nonce = json.loads((root / ".runs" / f"{ended[0]['run_id']}.json").read_text())["nonce"]
    last = read_last_run(root, ended[-1]["job_key"], nonce)
    assert last is not None and last.kind == "finished"


@pytest.mark.slow
def test_local_restart_gets_a_fresh_failure_budget(tmp_path: Path) -> None:
    """--max-failures 1: every restart crashes once at start; restart 0 is warned at step 3. Each
    restart may use its own retry, as a requeued Slurm job would."""
    proc, root, piddir = submit_local(tmp_path, 8, extra=("--max-failures", "1"), LC_CRASH_ONCE="1",
                                      LC_WARN_AT="3")
    out = finish(proc)
    assert proc.returncode == 0, out
    ended = [e["outcome"] for e in events(root) if e["event"] == "run_ended"]
    assert ended == ["failed", "preempted", "failed", "finished"], out


@pytest.mark.slow
def test_script_that_never_saves_is_flagged(tmp_path: Path) -> None:
    script = tmp_path / "nosave.py"
    script.write_text("import slurmresume\nslurmresume.Checkpointer()\nprint('trained, saved nothing')\n")
    proc, root, _ = submit_local(tmp_path, 1, script=script)
    out = finish(proc)
    assert "no_checkpoint" in names(root), out
    assert "WARNING" in out and "no checkpoint" in out


@pytest.mark.slow
def test_warned_run_that_saved_nothing_is_not_success(tmp_path: Path) -> None:
    proc, root, _ = submit_local(tmp_path, 10, LC_WARN_AT="2", LC_IGNORE_WARNING="1")
    out = finish(proc)
    assert proc.returncode != 0, out
    assert "warned_without_save" in names(root) and "gave_up" in names(root), out
    assert "WARNING" in out
    assert committed(root) == []


def _tree(pid: int) -> dict[int, int]:
    from slurmresume.job.guardian import walk

    known = {pid: start_time(pid) or 0}
    walk(known)
    return known


def _alive(tree: dict[int, int]) -> list[int]:
    return [p for p, st in tree.items() if start_time(p) == st and not _zombie(p)]


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


@pytest.mark.slow
@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT"])
def test_nothing_outlives_the_launcher(tmp_path: Path, how: str) -> None:
    """Ranks and their DataLoader workers are gone soon after the launcher is SIGKILLed (the
    guardian) or interrupted (SIGINT: a best-effort save, an `interrupted` event, no requeue)."""
    proc, root, piddir = submit_local(tmp_path, 100000, 0.05, LC_WORKERS="2")
    try:
        wait_for(lambda: progress(piddir) >= 3, what="training to reach step 3")
        tree = _tree(proc.pid)
        assert len(tree) >= 5, tree  # launcher, guardian, agent, rank, 2 DataLoader workers
        os.kill(proc.pid, getattr(signal, how))
        if how == "SIGINT":
            out, _ = proc.communicate(timeout=60)
        end = time.monotonic() + 30  # a hang guard: they go within seconds (was a fixed 15 s sleep)
        while _alive(tree) and time.monotonic() < end:
            time.sleep(0.1)
        assert _alive(tree) == [], [Path(f"/proc/{p}/cmdline").read_bytes() for p in _alive(tree)]
        if how == "SIGINT":
            ev = names(root)
            assert "interrupted" in ev and "requeued" not in ev and "stopped" in ev, out
            assert committed(root), out  # the best-effort save
    finally:
        for p in _alive(_tree(proc.pid)) if proc.poll() is None else []:
            os.kill(p, signal.SIGKILL)


FAKE_SCONTROL = """#!/bin/bash
# a slow slurmctld for `show` queries; remembers that it was asked
echo "$@" >> "$FAKE_LOG"
if [ "$1" = show ] && [ ! -e "$FAKE_LOG.entered" ]; then touch "$FAKE_LOG.entered"; sleep 4; fi
case "$1 $2" in
  "show hostnames") echo localhost ;;
  "show node") echo "NodeName=localhost NodeAddr=127.0.0.1" ;;
  "show job") echo "JobId=1 JobState=RUNNING TimeLimit=01:00:00" ;;
  "show config") echo "KillWait = 5 sec" ;;
  requeue*) exit 0 ;;
esac
"""


def fake_slurm_node(tmp_path: Path, job_id: str, scontrol: str = FAKE_SCONTROL) -> tuple[Path, Path, dict[str, str]]:
    """A one-node "Slurm job" on this host for a NodeLauncher run in a child process: a fake
    `scontrol` on PATH, the job's SLURM_* variables. Returns (root, fake scontrol log, env)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(scontrol)
    (bindir / "scontrol").chmod(0o755)
    root, piddir, fake_log = tmp_path / "ckpt", tmp_path / "pids", tmp_path / "scontrol.log"
    env = clean_env(PIDDIR=str(piddir), PYTHONPATH=os.environ.get("PYTHONPATH", ""), FAKE_LOG=str(fake_log),
                    PATH=f"{bindir}:{os.environ['PATH']}", SLURM_JOB_ID=job_id, SLURM_JOB_NODELIST="localhost",
                    SLURM_NODEID="0", SLURM_NNODES="1")
    return root, fake_log, env


@pytest.mark.slow
def test_warning_during_start_up_does_not_kill_the_launcher(tmp_path: Path) -> None:
    """The relay is installed before any scontrol call: a warning while slurmctld is slow to
    answer is kept, relayed, saved, and the job requeued."""
    root, fake_log, env = fake_slurm_node(tmp_path, "4242")
    code = ("import sys; from pathlib import Path; from slurmresume.job.config import JobSpec; "
            "from slurmresume.job.node import NodeLauncher; "
            f"NodeLauncher(JobSpec(script=Path({str(LC_TRAIN)!r}), script_args=('200', '0.05'), "
            f"ckpt_dir=Path({str(root)!r})))()")
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: Path(f"{fake_log}.entered").exists(), what="the first scontrol show job")
        os.kill(proc.pid, signal.SIGUSR1)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 75, out  # requeued (LAUNCHER_EXIT_REQUEUED), not killed by SIGUSR1
    assert "requeue 4242" in fake_log.read_text()
    ev = events(root)
    assert [e["event"] for e in ev].count("exit_after_save") == 1, out
    assert [e["event"] for e in ev].count("requeued") == 1


@pytest.mark.slow
def test_a_warning_after_the_run_finished_does_not_fail_the_job(tmp_path: Path) -> None:
    """Slurm may send the `@lead` warning up to a minute early, so it can land after the run has
    finished, while submitit is still writing its result and exiting (seen in CI: the task died of
    SIGUSR1 after "Exiting after successful completion", and a COMPLETED job was recorded FAILED).
    Once the launcher has returned, a late warning is ignored: there is nothing left to save."""
    root, _, env = fake_slurm_node(tmp_path, "4243", FAKE_SCONTROL.replace("sleep 4", "true"))
    code = ("import os, signal, time; from pathlib import Path; from slurmresume.job.config import JobSpec; "
            "from slurmresume.job.node import NodeLauncher; "
            f"NodeLauncher(JobSpec(script=Path({str(LC_TRAIN)!r}), script_args=('4', '0.01'), "
            f"ckpt_dir=Path({str(root)!r})))(); "
            "print('launcher returned', flush=True); "
            "os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2); print('exiting after the late warning')")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert "launcher returned" in out, out
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}"  # not -SIGUSR1
    assert "exiting after the late warning" in out
    assert [e["event"] for e in events(root)].count("exit_after_save") == 0  # nothing was saved for it

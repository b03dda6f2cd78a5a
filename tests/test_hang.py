"""Hangs (issue #14): heartbeats, budgets, the in-allocation restart, stack dumps, the false
positive that must not happen. Pure decisions as tables; the rest with real torchrun processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.procs import HELPERS, alive_for_root, clean_env, signal_tree

from slurmresume.beatfile import (
    RING,
    SAVE,
    STARTUP,
    STEP,
    Record,
    read_record,
    record_path,
)
from slurmresume.job.hang import (
    HangBudgets,
    budget,
    judge,
    parse_hang_timeout,
    percentile,
    stragglers,
)
from slurmresume.job.torchrun import RunResult, decide
from slurmresume.train.heartbeat import Beat

HANG_TRAIN = HELPERS / "hang_train.py"


def rec(phase: str = STEP, step: int = 10, t: float = 100.0, longest: float = 0.05, save: float = 0.0,
        seen: int = 10) -> Record:
    return Record(1, 0, phase, step, t, t, longest, save, seen, ())


B = HangBudgets()


# -- budgets: a table --------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("record", "budgets", "phase", "seconds"),
    [
        (None, B, "unknown", float("inf")),  # no record: never judged
        (rec(STARTUP), B, STARTUP, 900.0),
        (rec(seen=3), B, STEP, 900.0),  # still in the warm-up steps
        (rec(longest=0.05), B, STEP, 10 * 0.05 + 600),
        (rec(longest=2.0), B, STEP, 10 * 2.0 + 600),
        (rec(longest=2.0), HangBudgets(timeout_s=45), STEP, 45.0),  # --hang-timeout 45
        (rec(SAVE), B, SAVE, 300.0),  # no save measured yet: the floor
        (rec(SAVE, save=100.0), B, SAVE, 5 * 100 + 300.0),
        (rec("restore"), B, "restore", 900.0),  # restore: at least the start-up budget
        (rec("busy"), B, "busy", 900.0),
        # busy is never shorter than the step budget (60 s steps: 10 x 60 + 600), ckpt.busy(budget_s=) wins over
        # --hang-busy, and never below the step budget either
        (rec("busy", longest=60.0), B, "busy", 1200.0),
        (rec("busy", longest=60.0), HangBudgets(busy_s=100), "busy", 1200.0),
        (Record(1, 0, "busy", 10, 100.0, 100.0, 0.05, 0.0, 10, (), 0.0, 3600.0), B, "busy", 3600.0),
        (rec("busy"), HangBudgets(busy_s=30, timeout_s=45), "busy", 45.0),
        (rec(SAVE), HangBudgets(save_floor_s=1800), SAVE, 1800.0),  # --hang-save
        (rec(STARTUP), HangBudgets(startup_s=60), STARTUP, 60.0),  # --hang-startup
        (rec("done"), B, "done", float("inf")),
    ],
)
def test_budget(record: Record | None, budgets: HangBudgets, phase: str, seconds: float) -> None:
    assert budget(record, budgets) == (phase, pytest.approx(seconds))


def test_save_budget_uses_the_logged_save_cost() -> None:
    assert budget(rec(SAVE), B, save_cost_s=60.0)[1] == pytest.approx(5 * 60 + 300)


def test_judge_names_the_rank_over_budget_and_everyone_state() -> None:
    b = HangBudgets(floor_s=1.0)  # budget 10 x 0.05 + 1 = 1.5 s
    records = {0: rec(step=8, t=100.0), 1: rec(step=7, t=99.0), 2: None}
    assert judge(records, now=100.4, b=b) is None  # rank 1 silent 1.4 s
    hang = judge(records, now=100.6, b=HangBudgets(floor_s=1.0, startup_s=1000))
    assert hang is not None and hang.ranks == (1,) and hang.step == 7 and hang.phase == STEP
    assert hang.ranks_state[0] == {"step": 8, "phase": STEP, "age_s": 0.6}
    assert hang.ranks_state[2] == {"step": None, "phase": "unknown", "age_s": None}  # shown, never judged
    # both silent: the one behind is the suspect (the other passed its step and waits for it)
    both = judge({0: rec(step=8, t=100.0), 1: rec(step=7, t=99.95)}, now=102.0, b=b)
    assert both is not None and both.ranks == (1,) and both.over == (0, 1) and both.step == 7
    # only the waiting rank crossed its (smaller) budget: the rank behind it is still the suspect
    # (seen in CI: rank 1 hung before step 6, rank 0 waited at step 6 and crossed first)
    waiting = judge({0: rec(step=6, t=100.0), 1: rec(step=5, t=99.9, longest=0.5)}, now=101.55, b=b)
    assert waiting is not None and waiting.over == (0,) and waiting.ranks == (1,) and waiting.step == 5
    assert judge(records, now=1e9, b=HangBudgets(enabled=False)) is None


@pytest.mark.parametrize(("text", "parsed"), [("auto", (True, None)), ("off", (False, None)), ("600", (True, 600.0)),
                                              ("90s", (True, 90.0)), (" AUTO ", (True, None))])
def test_parse_hang_timeout(text: str, parsed: tuple) -> None:
    assert parse_hang_timeout(text) == parsed


@pytest.mark.parametrize("bad", ["", "0", "-5", "soon", "nan", "inf"])
def test_parse_hang_timeout_refuses(bad: str) -> None:
    from slurmresume.errors import ConfigError

    with pytest.raises(ConfigError, match="auto, off or a positive number"):
        parse_hang_timeout(bad)


# -- decide() after a hang: a table ------------------------------------------------------------

def _hung(ranks: tuple[int, ...] = (1,), step: int = 7, before: int | None = 5, after: int | None = 5) -> RunResult:
    hang = judge({r: rec(step=step, t=0.0) for r in ranks}, now=1e6, b=B)
    return RunResult(-9, None, before, after, hang=hang)


@pytest.mark.parametrize(
    ("result", "kw", "action", "says"),
    [
        (_hung(), {}, "retry", "restart 1 of 3 (--max-hangs) in this allocation"),
        (_hung(), {"hangs_done": 3}, "give_up", "--max-hangs 3 is used up"),
        (_hung(), {"max_hangs": 0}, "give_up", "--max-hangs 0"),
        # the same ranks stop at the same step again and nothing new was committed: hold
        (_hung(), {"hangs_done": 1, "previous_hang": ((1,), 7)}, "hold", "the same hang"),
        # same hang but this run committed a newer step: it progressed, restart again
        (_hung(after=7), {"hangs_done": 1, "previous_hang": ((1,), 7)}, "retry", "restart 2 of 3"),
        (_hung(step=9), {"hangs_done": 1, "previous_hang": ((1,), 7)}, "retry", "restart 2"),
        (_hung(ranks=(0,)), {"hangs_done": 1, "previous_hang": ((1,), 7)}, "retry", "rank(s) 0 hung"),
    ],
)
def test_decide_after_a_hang(result: RunResult, kw: dict, action: str, says: str) -> None:
    args = {"first_node": True, "requeues_done": 0, "max_requeues": None, "failures_done": 0, "max_failures": 0,
            "previous_progressed": True, "hangs_done": 0, "max_hangs": 3, **kw}
    got, reason = decide(result, **args)
    assert (got, says in reason) == (action, True), reason


def test_percentile_and_stragglers() -> None:
    assert percentile([], 50) is None
    assert percentile(list(range(1, 101)), 50) == 50 and percentile(list(range(1, 101)), 99) == 99
    med = {0: 0.10, 1: 0.10, 2: 0.13, 3: 0.11}
    assert stragglers(med, dict.fromkeys(med, 50)) == [2]  # 30% above the others' median
    assert stragglers(med, {**dict.fromkeys(med, 50), 2: 5}) == []  # too few samples to say


# -- the heartbeat record -----------------------------------------------------------------------

def test_heartbeat_round_trip_and_ring(tmp_path: Path) -> None:
    beat = Beat(tmp_path, 3, warmup=2)
    assert read_record(record_path(tmp_path, 3)).phase == STARTUP
    for s in range(1, RING + 20):
        beat.beat_step(s)
    began = beat.enter(SAVE)
    time.sleep(0.05)
    beat.leave(began, measured_save=True)
    got = read_record(record_path(tmp_path, 3))
    assert got is not None and got.pid == os.getpid() and got.rank == 3
    assert (got.phase, got.step, got.steps_seen, len(got.durations)) == (STEP, RING + 19, RING + 19, RING)
    assert got.longest_save >= 0.05 and got.longest_step > 0
    record_path(tmp_path, 4).write_bytes(b"garbage")  # a torn or foreign file reads as no record
    assert read_record(record_path(tmp_path, 4)) is None


def test_heartbeat_costs_far_under_one_percent_of_a_50ms_step(tmp_path: Path) -> None:
    beat = Beat(tmp_path, 0)
    n = 20000
    t = time.perf_counter()
    for s in range(n):
        beat.beat_step(s)
    per_step = (time.perf_counter() - t) / n
    assert per_step < 0.01 * 0.050 / 10, f"{per_step * 1e6:.1f} us per heartbeat"  # < 0.1% of 50 ms


def test_checkpointer_reports_each_phase(tmp_path: Path, monkeypatch) -> None:
    """What the launcher sees of one rank: start-up until step(), step, save (measured), restore,
    busy (an evaluation), done after close(); bare runs write nothing."""
    from helpers.core import tiny_state

    from slurmresume import Checkpointer
    hb = tmp_path / "hb"
    hb.mkdir()
    monkeypatch.setenv("SLURMRESUME_HEARTBEAT_DIR", str(hb))
    phase = lambda: read_record(record_path(hb, 0)).phase  # noqa: E731
    ckpt = Checkpointer(tmp_path / "ckpt", handle_signals=False, save_every=2)
    assert phase() == STARTUP
    state = tiny_state(1)
    assert ckpt.restore(state) == 0 and phase() == STARTUP  # restore ends where it began: no step yet
    ckpt.step(1, state)
    assert phase() == STEP and read_record(record_path(hb, 0)).step == 1
    ckpt.step(2, state)  # a periodic save inside step(): measured, then back to stepping
    got = read_record(record_path(hb, 0))
    assert got.phase == STEP and got.longest_save > 0
    with ckpt.busy("eval"):
        assert phase() == "busy"
    assert phase() == STEP
    ckpt.close()
    assert phase() == "done"
    monkeypatch.delenv("SLURMRESUME_HEARTBEAT_DIR")
    bare = Checkpointer(tmp_path / "ckpt2", handle_signals=False)
    with bare.busy():
        pass
    bare.close()
    assert sorted(p.name for p in hb.iterdir()) == ["rank-00000.hb"]


# -- status: per rank, stragglers, the last hang --------------------------------------------------

def test_status_shows_ranks_stragglers_and_the_last_hang(tmp_path: Path, monkeypatch) -> None:
    import io

    from rich.console import Console

    from slurmresume.cli import render as _render
    from slurmresume.tools import status
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)
    now = 1_000_000.0
    runs = tmp_path / ".runs"
    runs.mkdir()
    rows = {str(r): {"step": 500, "phase": "step", "time": now - 1.0, "median_s": 0.10, "p99_s": 0.12,
                     "samples": 256} for r in range(4)}
    rows["2"] = {**rows["2"], "median_s": 0.13, "p99_s": 0.20}  # 30% slower: a straggler
    rows["3"] = {**rows["3"], "step": 499, "time": now - 40.0}
    old = {"time": now - 999, "budgets": "x", "ranks": {"0": {"step": 1, "phase": "step", "time": now - 999}}}
    (runs / "slurm-1.node-0.ranks.json").write_text(json.dumps(old))  # an older job's view: not shown
    for node, ranks in ((0, ("0", "1")), (1, ("2", "3"))):
        view = {"time": now - 0.5, "budgets": "step: 10x longest step + 120 s", "ranks": {r: rows[r] for r in ranks}}
        (runs / f"slurm-2.node-{node}.ranks.json").write_text(json.dumps(view))
    hang = {"time": now - 3600, "event": "hang", "run_id": "slurm-2.0.0", "ranks": [3], "step": 210, "phase": "step",
            "silent_s": 125.0, "budget_s": 121.0, "dump_dir": "/ckpt/logs/slurm-2.0.0/hang-20261203T030000Z"}
    (tmp_path / "events.jsonl").write_text(json.dumps(hang) + "\n")
    st = status.compute_status(tmp_path, now=now)
    assert st.ranks is not None and st.ranks["job_key"] == "slurm-2" and sorted(st.ranks["ranks"]) == list("0123")
    assert st.ranks["stragglers"] == [2] and st.ranks["ranks"]["3"]["age_s"] == 40.0
    assert st.last_hang is not None and st.last_hang["dump_dir"].endswith("hang-20261203T030000Z")
    assert st.to_json()["last_hang"]["hangs"] == 1
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(_render.status_view(st, 20))
    text = out.getvalue()
    assert "straggler (> 20% slower)" in text and "hang-20261203T030000Z" in text and "rank(s) [3]" in text
    assert "130ms" in text and "200ms" in text  # rank 2's median and p99


# -- with real processes ------------------------------------------------------------------------

def _local(tmp_path: Path, args: list[str], env: dict[str, str], budgets: str) -> subprocess.Popen:
    """`run_local` with small budgets (the library's own fields; the CLI exposes --hang-timeout)."""
    code = ("import sys, json; from pathlib import Path; from slurmresume.job.config import JobSpec; "
            "from slurmresume.job.hang import HangBudgets; from slurmresume.job.node import run_local; "
            f"spec = JobSpec(script=Path({str(HANG_TRAIN)!r}), script_args=tuple(sys.argv[1:]), "
            f"ckpt_dir=Path({str(tmp_path / 'ckpt')!r}), nproc_per_node=2, max_hangs=2, max_failures=1, "
            f"hang_budgets=HangBudgets({budgets})); print(json.dumps(run_local(spec)))")
    return subprocess.Popen([sys.executable, "-c", code, *args], env=clean_env(PIDDIR=str(tmp_path / "pids"), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)


def _events(root: Path) -> list[dict]:
    return [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_slow_step_and_slow_save_are_not_a_hang(tmp_path: Path) -> None:
    """Step budget 10 x longest + 0.5 s (about 1 s here): one step 10x the usual (0.5 s) and a 2 s
    save (judged by the save budget, not the step budget) must not be killed."""
    proc = _local(tmp_path, ["30", "0.05", "12", "10", "2.0", "15"], {},
                  "floor_s=0.5, startup_s=60, save_floor_s=4")
    out = _finish(proc)
    assert proc.returncode == 0, out
    ev = _events(tmp_path / "ckpt")
    assert [e for e in ev if e["event"] == "hang"] == [], out
    assert any(e["event"] == "finished" and e["step"] == 30 for e in ev)
    saves = [e for e in ev if e["event"] == "save_committed"]
    assert saves and max(e["seconds"] for e in saves) >= 2.0  # the slow save really was slow


@pytest.mark.slow
def test_same_hang_twice_stops_with_stacks_of_every_rank(tmp_path: Path) -> None:
    """Rank 1 hangs at step 6 in attempt 0 and again in attempt 1, nothing committed between:
    two hang events, every rank's stacks dumped each time (the hung rank's at the frame it hung in),
    the run stops with the reason, and no training process is left."""
    proc = _local(tmp_path, ["40", "0.05"], {"SLURMRESUME_DRILL_HANG": "1:6,1:6"},
                  "floor_s=1.5, startup_s=60, save_floor_s=10")
    out = _finish(proc)
    assert proc.returncode != 0 and "the same hang as the previous run" in out, out
    ev = _events(tmp_path / "ckpt")
    hangs = [e for e in ev if e["event"] == "hang"]
    assert [(h["ranks"], h["step"], h["phase"]) for h in hangs] == [([1], 5, "step")] * 2, out
    for h in hangs:
        folder = Path(h["dump_dir"])
        assert folder.parent.parent == tmp_path / "ckpt" / "logs" and folder.name.startswith("hang-")
        assert sorted(p.name for p in folder.iterdir()) == ["rank-0.txt", "rank-1.txt"]
        hung = (folder / "rank-1.txt").read_text()
        assert "HUNG" in hung and "drill_hang_here" in hung and "hang_train.py" in hung
        assert "Thread" in (folder / "rank-0.txt").read_text()
        assert h["rank_states"]["0"]["step"] == 6 and h["rank_states"]["1"]["step"] == 5
        assert 0 < h["dump_s"] < 6 and h["detect_latency_s"] >= h["budget_s"]
    assert [e.get("action") for e in ev if e["event"] == "run_ended"] == ["retry", "hold"]
    assert any(e["event"] == "held" for e in ev)
    from slurmresume.tools.status import compute_status

    st = compute_status(tmp_path / "ckpt")  # the headline says why, the last hang says where to look
    assert st.verdict is not None and st.verdict.verdict == "stopped" and "held" in st.verdict.reason
    assert st.last_hang is not None and st.last_hang["dump_dir"] == hangs[-1]["dump_dir"]
    assert [e["cause"] for e in ev if e["event"] == "resumed"] == ["hang"]
    assert not any(e["event"] == "requeued" for e in ev)
    assert alive_for_root(str(HANG_TRAIN), tmp_path / "ckpt") == []  # this run's: test_slurm_hang runs the same script


@pytest.mark.slow
def test_a_killed_rank_restarts_in_the_allocation_and_the_recovery_is_timed(tmp_path: Path) -> None:
    proc = _local(tmp_path, ["60", "0.1", "-1", "1", "0", "5"], {}, "floor_s=3, startup_s=60, save_floor_s=10")
    piddir = tmp_path / "pids"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if int((piddir / "progress1").read_text() or 0) >= 12:
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    victim = int((piddir / "rank1.pid").read_text())
    killed = time.time()
    os.kill(victim, signal.SIGKILL)
    out = _finish(proc)
    assert proc.returncode == 0, out
    ev = _events(tmp_path / "ckpt")
    assert [e.get("action") for e in ev if e["event"] == "run_ended"] == ["retry", "finish"], out
    resumed = [e for e in ev if e["event"] == "resumed"]
    assert len(resumed) == 1 and resumed[0]["cause"] == "failure"
    assert 0 < resumed[0]["seconds"] < 120 and resumed[0]["step"] >= 10
    restarted = [e["time"] for e in ev if e["event"] == "started"][1]
    assert resumed[0]["seconds"] >= restarted - killed - 0.5  # measured from the death, not from the restart
    assert not any(e["event"] in ("requeued", "hang") for e in ev)


@pytest.mark.slow
def test_hang_drill_passes_on_the_example_with_two_ranks(tmp_path: Path) -> None:
    """The issue's proof: `drill --hang 1` on examples/train.py, 2 ranks: detected, every rank
    dumped (the hung rank at its frame), restarted in the allocation, bitwise equal at the end.
    About 60-90 s on a busy 2-core machine (three torchrun start-ups)."""
    from helpers.procs import EXAMPLE

    work = tmp_path / "drill"
    proc = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(EXAMPLE), "--hang", "1",
                           "--nproc-per-node", "2", "--workdir", str(work), "--json", "--", "--steps", "14",
                           "--save-every", "4"], env=clean_env(), capture_output=True, text=True, timeout=240)
    report = json.loads(proc.stdout[proc.stdout.index("{\n"):])
    assert proc.returncode == 0 and report["ok"], proc.stdout[-3000:] + proc.stderr[-3000:]
    (planned,) = report["hangs"]["planned"]
    (hang,) = report["hangs"]["detected"]
    assert hang["ranks"] == [planned["rank"]] and hang["step"] == planned["step"] - 1
    dump = Path(hang["dump_dir"]) / f"rank-{planned['rank']}.txt"
    assert "drill_hang_here" in dump.read_text() and "train.py" in dump.read_text()
    assert report["differences"] == [] and report["hangs"]["resumed"][0]["cause"] == "hang"
    assert alive_for_root(str(EXAMPLE), work) == []  # this drill's: other tests run the example meanwhile


def test_a_run_failed_by_another_nodes_hang_kill_counts_as_that_hang(tmp_path: Path) -> None:
    """Multi-node: node A kills its hung ranks; node B's ranks then fail in a collective. B's
    launcher reads A's hang record (contract.write_hang) and restarts as for a hang, so every node
    restarts together and the run is not failed by --max-failures 0."""
    from slurmresume.contract import write_hang
    from slurmresume.job.hangwatch import HangWatch
    from slurmresume.job.torchrun import Relay, run_torchrun

    root, hb = tmp_path / "ckpt", tmp_path / "hb"
    root.mkdir()
    hb.mkdir()
    write_hang(root, "job.0.0", {"ranks": [5], "step": 11, "phase": "step", "silent_s": 130.0, "budget_s": 121.0})
    crash = [sys.executable, "-c", "raise SystemExit(3)"]
    kw = {"first_node": True, "requeues_done": 0, "max_requeues": None, "failures_done": 0, "max_failures": 0,
          "previous_progressed": True, "max_hangs": 3}
    got = run_torchrun(crash, dict(os.environ), root, "job.0.0", signal.SIGUSR1, Relay(signal.SIGUSR1),
                       watch=HangWatch(hb, B, procs=2))
    assert got.kind == "hung" and got.hang is not None and got.hang.key == ((5,), 11)
    assert decide(got, **kw)[0] == "retry"
    other = run_torchrun(crash, dict(os.environ), root, "job.0.1", signal.SIGUSR1, Relay(signal.SIGUSR1),
                         watch=HangWatch(hb, B, procs=2))
    assert other.kind == "failed" and decide(other, **kw)[0] == "give_up"  # no record for that run: a crash


# -- issue #26: what must never be judged, and the read-found bugs -------------------------------

def test_a_rank_whose_heartbeat_writes_fail_is_not_watched_and_never_hung(tmp_path: Path, monkeypatch) -> None:
    """A full tmpfs: open works, pwrite fails with ENOSPC. The rank empties its record (one
    warning line) and stops writing; the launcher shows it as "not watched", never as hung."""
    import errno

    from slurmresume.job.hangwatch import HangWatch
    from slurmresume.train import heartbeat

    def enospc(fd: int, data: bytes, offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(heartbeat.os, "pwrite", enospc)
    beat = Beat(tmp_path, 2)
    beat.beat_step(1)
    assert beat.failed and record_path(tmp_path, 2).stat().st_size == 0
    watch = HangWatch(tmp_path, HangBudgets(startup_s=1, floor_s=1), procs=1)
    now = time.monotonic()
    assert watch.poll(now, [os.getpid()]) is None
    assert watch.poll(now + 3600, [os.getpid()]) is None and watch.unwatched == {2}
    assert watch.summary(now + 3600)["ranks"]["2"]["phase"] == "not watched"
    beat.close()


def test_poll_keeps_judging_the_other_ranks_after_one_exits(tmp_path: Path) -> None:
    """Rank 0 finishes early and exits; rank 1 then hangs: still caught (the old watch stopped
    judging for the rest of the run once any rank's process was gone)."""
    from slurmresume.job.hangwatch import HangWatch

    early = subprocess.Popen([sys.executable, "-c", "import sys; from pathlib import Path; "
                              "from slurmresume.beatfile import DONE; from slurmresume.train.heartbeat import Beat; "
                              f"b = Beat(Path({str(tmp_path)!r}), 0); b.beat_step(1); b.enter(DONE)"],
                             env=clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", "")))
    beat = Beat(tmp_path, 1)
    beat.beat_step(1)
    watch = HangWatch(tmp_path, HangBudgets(startup_s=5, floor_s=1), procs=2)
    now = time.monotonic()
    assert watch.poll(now, [early.pid, os.getpid()]) is None
    early.wait(timeout=60)
    assert watch.poll(now + 1, [os.getpid()]) is None  # rank 0 gone: a death seen, rank 1 fine
    hang = watch.poll(now + 60, [os.getpid()])
    assert hang is not None and hang.ranks == (1,) and 0 not in hang.over
    beat.close()


def test_two_beats_in_one_process_keep_the_stack_dump_registered(tmp_path: Path) -> None:
    """Two Checkpointers in one process: closing either leaves the dump signal registered for
    the other (the old close unregistered it), and closing both unregisters it."""
    got: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda s, f: got.append(s))  # what an unregistered dump falls back to
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    try:
        a, b = Beat(a_dir, 0), Beat(b_dir, 1)
        a.register_dumps(a_dir, signal.SIGUSR2)
        b.register_dumps(b_dir, signal.SIGUSR2)
        a.close()  # not the holder: b's registration stays
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        assert got == [] and "most recent call first" in (b_dir / "rank-00001.stacks").read_text()
        c = Beat(a_dir, 2)
        c.register_dumps(a_dir, signal.SIGUSR2)
        c.close()  # the holder: handed back to b
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        assert got == [] and (b_dir / "rank-00001.stacks").read_text().count("most recent call first") >= 2
        b.close()  # the last one: unregistered, the previous handler is back
        os.kill(os.getpid(), signal.SIGUSR2)
        time.sleep(0.2)
        assert got == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_the_wait_for_torchrun_after_a_hang_kill_is_bounded(monkeypatch) -> None:
    """An agent that cannot die (D state on a hung NFS) must not block the restart."""
    from slurmresume.job import torchrun

    monkeypatch.setattr(torchrun, "KILL_REAP_S", 0.3)
    stuck = subprocess.Popen(["sleep", "30"])
    try:
        began = time.monotonic()
        assert torchrun._reap(stuck, "job.0.0") == -signal.SIGKILL
        assert time.monotonic() - began < 5
    finally:
        stuck.kill()
        stuck.wait()


def test_a_hang_before_any_checkpoint_says_from_the_start() -> None:
    action, reason = decide(_hung(before=None, after=None), first_node=True, requeues_done=0, max_requeues=None,
                            failures_done=0, max_failures=0, previous_progressed=None, max_hangs=3)
    assert action == "retry" and "from the start (no complete checkpoint yet)" in reason and "None" not in reason


def test_a_save_whose_files_grow_is_alive_and_one_that_stops_is_not(tmp_path: Path) -> None:
    """Save budget 1 s (--hang-save 1, no save measured yet): while the bytes of the save in
    progress under the root move, the saving rank is not silent; once they stop, it is judged
    from the last move (the old watch killed a big first save at the floor however it moved)."""
    from slurmresume.job.hangwatch import HangWatch

    root, hb = tmp_path / "ckpt", tmp_path / "hb"
    saving = root / ".saving.step_000000005.0123456789abcdef"
    saving.mkdir(parents=True)
    hb.mkdir()
    shard = saving / "rank-00000-of-00001.safetensors"
    shard.write_bytes(b"x" * 10)
    beat = Beat(hb, 0)
    beat.beat_step(5)
    beat.enter(SAVE)
    watch = HangWatch(hb, HangBudgets(save_floor_s=1.0), procs=1, root=root)
    t = time.monotonic()
    assert watch.poll(t, [os.getpid()]) is None
    shard.write_bytes(b"x" * 20)  # the writer moved bytes
    assert watch.poll(t + 1.5, [os.getpid()]) is None  # over the 1 s budget by its heartbeat, alive by its bytes
    assert watch.poll(t + 2.0, [os.getpid()]) is None
    hang = watch.poll(t + 2.7, [os.getpid()])  # nothing moved since t + 1.5
    assert hang is not None and hang.ranks == (0,) and hang.phase == SAVE and hang.silent_s == pytest.approx(1.2)
    beat.close()


def test_a_restore_whose_mirror_pull_moves_bytes_is_alive(tmp_path: Path) -> None:
    """The same for a restore pulling a step from the mirror into `<root>/.mirror-download.*`."""
    from slurmresume.job.hangwatch import HangWatch
    from slurmresume.mirror.transfer import DOWNLOAD_PREFIX

    root, hb = tmp_path / "ckpt", tmp_path / "hb"
    pull = root / f"{DOWNLOAD_PREFIX}step_000000005.1.abcdef12"
    pull.mkdir(parents=True)
    hb.mkdir()
    part = pull / "rank-00000-of-00001.safetensors"
    part.write_bytes(b"x")
    beat = Beat(hb, 0)
    beat.enter("restore")
    watch = HangWatch(hb, HangBudgets(startup_s=1.0, save_floor_s=1.0), procs=1, root=root)
    t = time.monotonic()
    assert watch.poll(t, [os.getpid()]) is None
    part.write_bytes(b"xx")
    assert watch.poll(t + 1.5, [os.getpid()]) is None
    hang = watch.poll(t + 2.7, [os.getpid()])
    assert hang is not None and hang.phase == "restore"
    beat.close()


@pytest.mark.slow
def test_a_hung_rank_is_killed_first_and_the_others_save_its_step(tmp_path: Path) -> None:
    """Issue 47, item 3. Rank 1 stops before step 12's collective (first run only); rank 0 waits
    for it there. After the stacks, the launcher SIGKILLs rank 1 alone: rank 0, at its boundary
    11 like rank 1, makes the failure-time save of step 11 and exits; the run restarts in the
    allocation from step 11 (no periodic save exists: the old kill of the whole tree restarted
    from step 0) and finishes."""
    proc = _local(tmp_path, ["30", "0.05"], {"HANG_ON": "0:1:12"}, "floor_s=1.5, startup_s=60, save_floor_s=10")
    out = _finish(proc, timeout=300)
    assert proc.returncode == 0, out
    ev = _events(tmp_path / "ckpt")
    hangs = [e for e in ev if e["event"] == "hang"]
    # the suspects: rank 1, or ranks 0 and 1 when rank 0's wait in the collective also passed the
    # budget before the verdict (load); either way rank 1 alone is killed (the highest suspect)
    assert [h["step"] for h in hangs] == [11] and hangs[0]["ranks"] in ([1], [0, 1]), out
    assert (tmp_path / "ckpt" / "logs").exists() and Path(hangs[0]["dump_dir"], "rank-1.txt").exists()
    saves = [e for e in ev if e["event"] == "failure_save"]
    assert [(e["step"], e["committed"], e["dead"]) for e in saves] == [(11, True, [1])], out
    assert [e["step"] for e in ev if e["event"] == "restored"] == [11]
    assert [e.get("action") for e in ev if e["event"] == "run_ended"] == ["retry", "finish"]
    assert any(e["event"] == "finished" and e["step"] == 30 for e in ev)


def test_failsave_victims() -> None:
    from slurmresume.job.hang import Hang, failsave_victims

    def hang(ranks: tuple[int, ...], states: int) -> Hang:
        return Hang(ranks, "step", 11, 5.0, 2.0, 0.0, {r: {} for r in range(states)})

    assert failsave_victims(hang((1,), 3), {0, 1, 2}) == (1,)  # the suspect alone; the others wait in a collective
    assert failsave_victims(hang((0, 1, 2), 3), {0, 1, 2}) == (2,)  # every rank stopped at one step: one goes
    assert failsave_victims(hang((1,), 3), {0, 1}) == ()  # rank 2 has no failure guard: kill the run as before
    assert failsave_victims(hang((), 3), {0, 1, 2}) == ()

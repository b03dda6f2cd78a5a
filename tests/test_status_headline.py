"""`status` answers at a glance: the three-line headline (healthy / at risk / stopped and why),
its exit codes, the same verdict in --json, and a --watch screen that shows the checkpoints."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest
from helpers.core import tiny_state
from rich.console import Console
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.cli import app
from slurmresume.cli import render as _render
from slurmresume.tools import status
from slurmresume.tools.health import EXIT_AT_RISK, EXIT_STOPPED
from slurmresume.tools.status import compute_status

ENV = {"COLUMNS": "80", "NO_COLOR": "1", "TERM": "dumb", "SLURMRESUME_CKPT_DIR": ""}


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)


def log(root: Path, *events: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "events.jsonl", "a") as f:
        for e in events:
            f.write(json.dumps({"host": "h", "pid": 1, "job_id": None, "restart": 0, **e}) + "\n")


def save(root: Path, *steps: int) -> float:
    ckpt = Checkpointer(root, handle_signals=False)
    for s in steps:
        ckpt.save(s, tiny_state(s))
    ckpt.close()
    (root / "events.jsonl").unlink()  # the test writes the history it wants
    return time.time()


def run_history(root: Path, t0: float, steps=(100, 200, 300), interval: float = 60.0) -> None:
    log(root, {"time": t0 - 200, "event": "submitted", "job": "4242"},
        {"time": t0 - 190, "event": "started", "run_id": "a.0.0"},
        *[{"time": t0 - 120 + 60 * i, "event": "save_committed", "step": s, "seconds": 0.5,
           "interval_s": interval, "reason": "periodic"} for i, s in enumerate(steps)])


def screen(st, width: int = 80, height: int | None = None) -> str:
    out = io.StringIO()
    Console(file=out, width=width, color_system=None).print(_render.status_view(st, 20, height=height))
    return out.getvalue()


def test_fresh_root_is_starting(tmp_path):
    st = compute_status(tmp_path)
    assert st.verdict.verdict == "starting" and st.verdict.exit_code == 0
    lines = screen(st).splitlines()
    assert lines[1].startswith("STARTING  nothing logged yet")
    assert lines[2] == "step: none logged yet" and lines[3] == "checkpoint: none complete yet"


def test_healthy_run_headline(tmp_path):
    t0 = save(tmp_path, 100, 200, 300)
    run_history(tmp_path, t0)
    st = compute_status(tmp_path, now=t0 + 20, with_interval=True)
    h = st.verdict
    assert (h.verdict, h.reason, h.exit_code) == ("healthy", "running", 0)
    assert st.job.job_id == "4242"  # logged as `job` by submit, read back (was "job ?")
    assert h.last_step == 300 and h.steps_per_second == pytest.approx(200 / 120)
    assert h.checkpoint_step == 300 and h.at_stake_s == pytest.approx(20, abs=2)
    lines = screen(st).splitlines()
    assert lines[1].startswith("HEALTHY  running  (job 4242)")
    assert lines[2].startswith("step 300, ") and "1.67 steps/s" in lines[2]
    assert lines[3].startswith("checkpoint step 300, ") and "a crash now loses" in lines[3]
    text = "\n".join(lines)
    assert text.index("checkpoints (newest first)") < text.index("history (event log")
    assert "MTBF" not in text and "redoing work" not in text  # not meaningful from 3 saves


def test_at_risk_when_no_commit_for_longer_than_the_interval(tmp_path):
    t0 = save(tmp_path, 100, 200, 300)
    run_history(tmp_path, t0)
    st = compute_status(tmp_path, now=t0 + 600, with_interval=True)
    assert st.verdict.verdict == "at_risk" and st.verdict.exit_code == EXIT_AT_RISK
    assert "no checkpoint committed for 10m" in st.verdict.reason and "save interval 1m" in st.verdict.reason
    assert screen(st).splitlines()[1].startswith("AT RISK  no checkpoint committed")


@pytest.mark.parametrize("last,reason", [
    ({"event": "gave_up", "reason": "no progress in two runs"}, "gave up: no progress in two runs"),
    ({"event": "failed", "returncode": 1, "reason": "crash, no retries left"}, "failed: crash, no retries left"),
    ({"event": "requeue_failed", "error": "scontrol timed out"}, "requeue failed: scontrol timed out"),
])
def test_stopped_run(tmp_path, last, reason):
    t0 = save(tmp_path, 100, 200, 300)
    run_history(tmp_path, t0)
    log(tmp_path, {"time": t0 + 1, **last})
    st = compute_status(tmp_path, now=t0 + 30)
    assert (st.verdict.verdict, st.verdict.reason) == ("stopped", reason)
    assert st.verdict.exit_code == EXIT_STOPPED and st.verdict.at_stake_s is None


def test_finished_run_is_not_an_alarm(tmp_path):
    t0 = save(tmp_path, 100, 200, 300)
    run_history(tmp_path, t0)
    log(tmp_path, {"time": t0 + 1, "event": "finished", "step": 300})
    st = compute_status(tmp_path, now=t0 + 3600)
    assert (st.verdict.verdict, st.verdict.exit_code) == ("finished", 0)


def test_slurm_says_failed(tmp_path, monkeypatch):
    t0 = save(tmp_path, 100)
    run_history(tmp_path, t0, steps=(100,))

    def fake(args, timeout=10.0):
        if "--version" in args:
            return "slurm 22.05.8\n"
        return "" if args[0] == "squeue" else "4242|FAILED|00:03:00|n1|1:0\n"

    monkeypatch.setattr(status, "run_slurm", fake)
    st = compute_status(tmp_path, now=t0 + 10)
    assert (st.verdict.verdict, st.verdict.reason) == ("stopped", "Slurm reports job 4242 as FAILED")


def cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def test_exit_codes_and_json_carry_the_verdict(tmp_path):
    now = time.time()
    fresh, risk, stopped = tmp_path / "fresh", tmp_path / "risk", tmp_path / "stopped"
    fresh.mkdir()
    log(risk, {"time": now - 1000, "event": "started"},
        {"time": now - 900, "event": "save_committed", "step": 10, "seconds": 1, "interval_s": 60})
    log(stopped, {"time": now - 100, "event": "started"}, {"time": now - 50, "event": "gave_up", "reason": "r"})
    assert cli("status", "-d", fresh).exit_code == 0
    r = cli("status", "-d", risk)
    assert r.exit_code == EXIT_AT_RISK and any(line.startswith("AT RISK") for line in r.stdout.splitlines())
    assert cli("status", "-d", stopped).exit_code == EXIT_STOPPED
    data = json.loads(cli("status", "-d", stopped, "--json").stdout)
    assert data["verdict"]["verdict"] == "stopped" and data["verdict"]["exit_code"] == EXIT_STOPPED
    helptext = cli("status", "--help").stdout
    assert "3 at risk" in helptext and "4 stopped" in helptext


def test_watch_screen_at_80x30_shows_headline_and_checkpoints_first(tmp_path):
    t0 = save(tmp_path, *range(1, 26))
    run_history(tmp_path, t0, steps=range(1, 26))
    st = compute_status(tmp_path, now=t0 + 5, with_interval=True)
    lines = screen(st, 80, 30).splitlines()
    assert len(lines) <= 30
    assert lines[1].startswith("HEALTHY") and any(line.strip().startswith("25 ") for line in lines)
    assert any("older checkpoint directories not shown" in line for line in lines)


def test_limit_says_what_it_hides(tmp_path):
    save(tmp_path, 1, 2, 3, 4)
    r = cli("status", "-d", tmp_path, "--limit", "2")
    assert "2 older checkpoint directories not shown (--limit 0 shows all)" in r.stdout

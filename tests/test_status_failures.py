"""Issue 47.5: `status`, `status --json` and `status --plot` show each unwarned failure: where it
happened, the survivors' failure save (committed, or refused with what was missing, or none), the
steps the restart repeated and the seconds from the failure to its first step. The event logs are
written with the real event helpers, under the names the launcher and the failure save use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmresume.cli import app
from slurmresume.events import (
    EV_FAILED,
    EV_FAILURE_SAVE,
    EV_FINISHED,
    EV_GAVE_UP,
    EV_RESTORED,
    EV_RESUMED,
    EV_RUN_ENDED,
    EV_SAVE_COMMITTED,
    EV_STARTED,
    append_event,
)
from slurmresume.tools import status

ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", "SLURMRESUME_CKPT_DIR": ""}
T0 = 1_800_000_000.0
MISSING = "rank 0 ran an optimizer step after step 16; rank 2 ran an optimizer step after step 16"


def _run(root: Path, t: float, run_id: str, restored: int | None = None, resumed_s: float | None = None,
         commits: tuple[int, ...] = ()) -> None:
    """A run's start as the launcher and rank 0 log it: started, restored, the first step, saves."""
    append_event(root, EV_STARTED, time=t, run_id=run_id, node=0, restart=0)
    if restored is not None:
        append_event(root, EV_RESTORED, time=t + 2, run_id=run_id, step=restored)
    if resumed_s is not None:
        append_event(root, EV_RESUMED, time=t + 3, run_id=run_id, seconds=resumed_s, cause="failure",
                     first_step_at=t + 2.5, step=(restored or 0) + 1)
    for i, step in enumerate(commits):
        append_event(root, EV_SAVE_COMMITTED, time=t + 5 + i, run_id=run_id, step=step, seconds=0.1,
                     reason="periodic")


def _failed(root: Path, t: float, run_id: str, *, last_step: int | None, dead_steps: dict[str, int] | None,
            action: str = "retry") -> None:
    """The launcher's record of a run a rank died in."""
    append_event(root, EV_RUN_ENDED, time=t, run_id=run_id, outcome="failed", returncode=1, action=action,
                 reason="a rank failed", last_step=last_step, dead_steps=dead_steps)
    append_event(root, EV_FAILED, time=t, returncode=1, reason="a rank failed")


def committed_log(root: Path, t: float = T0) -> None:
    """Rank 2 dies after step 25; ranks 0 and 1 commit step 25; the restart resumes it 3.2 s later."""
    _run(root, t, "j.0.0", commits=(10, 20))
    append_event(root, EV_SAVE_COMMITTED, time=t + 30, run_id="j.0.0", step=25, seconds=0.41, reason="failure")
    append_event(root, EV_FAILURE_SAVE, time=t + 30, run_id="j.0.0", step=25, committed=True, dead=[2], writer=0,
                 seconds=0.41, error=None)
    _failed(root, t + 31, "j.0.0", last_step=25, dead_steps={"2": 25})
    _run(root, t + 32, "j.0.1", restored=25, resumed_s=5.0)  # first step at t + 34.5: the death at t + 29.5


def refused_log(root: Path, t: float = T0) -> None:
    """Rank 1 dies inside step 17 after its optimizer step, the others past theirs: refused; the
    restart resumes the periodic step 10 and trains 16 and 17 again... 7 steps."""
    _run(root, t, "j.0.0", commits=(10,))
    append_event(root, EV_FAILURE_SAVE, time=t + 30, run_id="j.0.0", step=None, committed=False, dead=[1],
                 missing=MISSING.split("; "))
    _failed(root, t + 31, "j.0.0", last_step=17, dead_steps={"1": 16})
    _run(root, t + 32, "j.0.1", restored=10, resumed_s=5.5)


def unsaved_log(root: Path, t: float = T0, run: str = "j.0.0", restart: str = "j.0.1", restored: int = 30,
                action: str = "retry") -> None:
    """No failure save at all (the guard was not active): the launcher's record alone."""
    _failed(root, t, run, last_step=37, dead_steps={"0": 37}, action=action)
    if action == "retry":
        _run(root, t + 1, restart, restored=restored, resumed_s=4.0)  # the death at t - 0.5


def _finish(root: Path, t: float, run_id: str) -> None:
    append_event(root, EV_SAVE_COMMITTED, time=t, run_id=run_id, step=60, seconds=0.1, reason="final")
    append_event(root, EV_RUN_ENDED, time=t + 1, run_id=run_id, outcome="finished", returncode=0, action="finish")
    append_event(root, EV_FINISHED, time=t + 1, step=60)


def _status(root: Path) -> tuple[str, dict]:
    text = CliRunner().invoke(app, ["status", "-d", str(root)], env=ENV)
    assert text.exception is None or isinstance(text.exception, SystemExit), text.output  # exit: the verdict
    data = CliRunner().invoke(app, ["status", "-d", str(root), "--json"], env=ENV)
    return " ".join(text.stdout.split()), json.loads(data.stdout)  # a long line wraps: compare words


@pytest.fixture(autouse=True)
def _no_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)


def test_a_committed_failure_save_shows_its_step_no_repeated_step_and_the_time_to_step_again(tmp_path: Path) -> None:
    root = tmp_path / "root"
    committed_log(root)
    _finish(root, T0 + 60, "j.0.1")
    text, data = _status(root)
    assert ("failure at step 25 (rank 2 died): failure save committed step 25 (rank 0, 0.41 s); resumed from "
            "step 25: 0 steps repeated, first step 5.0 s after the failure") in text, text
    (f,) = data["failures"]
    assert (f["kind"], f["step"], f["dead"], f["save"], f["save_step"], f["save_writer"]) == (
        "failed", 25, [2], "committed", 25, 0)
    assert (f["resumed_from"], f["trained"], f["repeated"], f["action"]) == (25, 25, 0, "retry")
    assert f["to_first_step_s"] == pytest.approx(5.0)
    assert f["at"] == pytest.approx(T0 + 29.5)  # the launcher's clock of the death
    # the same in the headline: down from the death to the first step; the commit came after the death
    assert "interruptions: down 5.0s, work lost 0.0s: " in text


def test_a_refused_failure_save_names_the_missing_pieces_and_the_steps_trained_again(tmp_path: Path) -> None:
    root = tmp_path / "root"
    refused_log(root)
    text, data = _status(root)
    assert (f"failure at step 16 (rank 1 died): failure save refused: missing {MISSING}; resumed from step 10: "
            "7 steps repeated, first step 5.5 s after the failure") in text, text
    assert "work lost 24.0s (7 steps)" in text  # to the death; steps: the launcher's, not estimated
    (f,) = data["failures"]
    assert (f["save"], f["save_step"], f["missing"], f["dead_steps"]) == ("refused", None, MISSING.split("; "),
                                                                          {"1": 16})
    assert (f["step"], f["trained"], f["resumed_from"], f["repeated"]) == (16, 17, 10, 7)


def test_a_failure_with_no_failure_save_is_shown_from_the_launchers_record(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _run(root, T0, "j.0.0", commits=(10, 20, 30))
    unsaved_log(root, T0 + 40)
    text, data = _status(root)
    assert ("failure at step 37 (rank 0 died): no failure save; resumed from step 30: 7 steps repeated, "
            "first step 4.0 s after the failure") in text, text
    (f,) = data["failures"]
    assert (f["save"], f["step"], f["dead"], f["repeated"]) == ("none", 37, [0], 7)


def test_a_failure_not_restarted_says_so(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _run(root, T0, "j.0.0", commits=(10,))
    unsaved_log(root, T0 + 40, action="give_up")
    append_event(root, EV_GAVE_UP, time=T0 + 40, reason="--max-failures 0")
    text, data = _status(root)
    assert "failure at step 37 (rank 0 died): no failure save; not restarted (give up)" in text, text
    assert data["failures"][0]["to_first_step_s"] is None and data["failures"][0]["repeated"] is None


def test_two_failures_each_with_its_own_restart(tmp_path: Path) -> None:
    root = tmp_path / "root"
    committed_log(root)
    unsaved_log(root, T0 + 60, run="j.0.1", restart="j.0.2", restored=25)
    _finish(root, T0 + 90, "j.0.2")
    text, data = _status(root)
    assert "unwarned failures: 2" in text
    assert "failure at step 25 (rank 2 died): failure save committed step 25" in text
    assert "failure at step 37 (rank 0 died): no failure save; resumed from step 25: 12 steps repeated" in text
    assert [(f["run_id"], f["save"], f["resumed_from"], f["repeated"]) for f in data["failures"]] == [
        ("j.0.0", "committed", 25, 0), ("j.0.1", "none", 25, 12)]
    assert [f["to_first_step_s"] for f in data["failures"]] == pytest.approx([5.0, 4.0])


def test_no_failure_no_section(tmp_path: Path) -> None:
    root = tmp_path / "root"
    _run(root, T0, "j.0.0", commits=(10, 20))
    _finish(root, T0 + 30, "j.0.0")
    text, data = _status(root)
    assert "unwarned failure" not in text and "failures" not in data


def test_the_plot_marks_each_failure_with_its_failure_save_and_cost(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from slurmresume.events import read_events
    from slurmresume.tools.plot import render_timeline

    root = tmp_path / "root"
    committed_log(root)
    unsaved_log(root, T0 + 60, run="j.0.1", restart="j.0.2", restored=25)
    _finish(root, T0 + 90, "j.0.2")
    fig = render_timeline(read_events(root))
    try:
        ax = fig.axes[0]
        diamonds = [(float(ln.get_xdata()[0]), float(ln.get_ydata()[0]), ln.get_color()) for ln in ax.lines
                    if ln.get_marker() == "D" and len(ln.get_xdata())]
        assert [(s, c) for _, s, c in diamonds] == [(25, "green"), (37, "grey")]
        assert [x for x, _, _ in diamonds] == pytest.approx([31.0, 60.0])  # on each failed run's end
        texts = [t.get_text() for t in ax.texts]
        assert "failure save: step 25 committed\n0 steps repeated, first step after 5.0s" in texts
        assert "no failure save\n12 steps repeated, first step after 4.0s" in texts
        assert [t for t in texts if t.startswith("down")] == ["down\n5.0s", "down\n4.0s"]  # from each death
        assert "failed: lost 0.0s" not in texts  # run 1 reached step 25 and committed it: nothing lost
    finally:
        plt.close(fig)
    out = tmp_path / "run.png"
    r = CliRunner().invoke(app, ["status", "-d", str(root), "--plot", str(out)], env=ENV)
    assert r.exit_code == 0, r.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_launcher_logs_how_far_the_ranks_got_and_who_died_first_at_which_step(tmp_path: Path) -> None:
    """Where a failure with no failure save happened comes from the launcher: its hang watch keeps
    the last step boundary of the rank whose process vanished first, and of every rank; `run_ended`
    carries both (and only a failed run names dead ranks)."""
    import os
    import subprocess
    import sys
    import time

    from helpers.procs import clean_env

    from slurmresume.events import read_events
    from slurmresume.job.decision import RunResult
    from slurmresume.job.hang import HangBudgets
    from slurmresume.job.hangwatch import HangWatch
    from slurmresume.job.node import _record
    from slurmresume.train.heartbeat import Beat

    hb = tmp_path / "hb"
    hb.mkdir()
    victim = subprocess.Popen([sys.executable, "-c", "import os, sys; from pathlib import Path; "
                               "from slurmresume.train.heartbeat import Beat; "
                               f"b = Beat(Path({str(hb)!r}), 0); b.beat_step(3); print('', flush=True); "
                               "sys.stdin.readline(); os._exit(1)"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=clean_env(PYTHONPATH=os.environ.get("PYTHONPATH", ""), RANK="0"))
    beat = Beat(hb, 1)
    try:
        beat.beat_step(4)
        assert victim.stdout is not None and victim.stdout.readline() == "\n"  # its step 3 is written
        watch = HangWatch(hb, HangBudgets(startup_s=600, floor_s=600), procs=2)
        now = time.monotonic()
        assert watch.poll(now, [victim.pid, os.getpid()]) is None and watch.dead_steps == {}
        victim.communicate("\n", timeout=60)  # rank 0 dies after its step 3
        assert watch.poll(now + 1, [os.getpid()]) is None
        assert watch.dead_steps == {0: 3} and watch.last_step() == 4
    finally:
        beat.close()
        if victim.poll() is None:
            victim.kill()
    root = tmp_path / "root"
    root.mkdir()
    common = {"outcome": None, "latest_before": 2, "latest_after": 2, "last_step": 4, "dead_steps": ((0, 3),)}
    for rc in (1, 0):
        _record(root, RunResult(rc, **common), "retry" if rc else "finish", "why", f"j.0.{rc}", "j", 0, True, "n")
    ended = [e for e in read_events(root) if e["event"] == EV_RUN_ENDED]
    assert [(e["outcome"], e["last_step"], e["dead_steps"]) for e in ended] == [
        ("failed", 4, {"0": 3}), ("finished", 4, None)]

"""`status --plot`: the timeline of a run with 2 preemptions and 1 failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.timeline import example_events, write_events
from typer.testing import CliRunner

from slurmresume.cli import app
from slurmresume.tools import status
from slurmresume.tools.timeline import build_timeline, cost_line, preemption_cost


def test_timeline_runs_and_lost_work():
    tl = build_timeline(example_events(t0=0.0))
    assert [r.end_kind for r in tl.runs] == ["preempt", "failed", "preempt", "finished"]
    assert [r.start_step for r in tl.runs] == [0, 892, 1492, 2324]
    assert len(tl.requeues) == 2 and len(tl.runs[0].warnings) == 1
    from slurmresume.tools.timeline import mark_lost

    mark_lost(tl)
    failed = tl.runs[1]
    assert failed.lost_s == pytest.approx(1790 - 1608) and failed.lost_steps > 0
    assert tl.runs[0].lost_s == 0 and tl.runs[2].lost_s == 0  # warned: the agreed step was saved


def test_status_plot_writes_a_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)
    write_events(tmp_path / "root", example_events())
    out = tmp_path / "run.png"
    r = CliRunner().invoke(app, ["status", "-d", str(tmp_path / "root"), "--plot", str(out)],
                           env={"COLUMNS": "100", "SLURMRESUME_CKPT_DIR": ""})
    assert r.exit_code == 0, r.output  # the run finished
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    assert f"timeline written to {out}" in r.stderr


# A real event log: `slurmresume drill examples/train.py --preemptions 3 --nproc-per-node 2
# -- --steps 60` on the shared 2-core machine (restarts slow under load): warnings agreed at steps
# 26, 50 and 56; each restart's first step logged by the launcher's `resumed` event.
DRILL_LOG = Path(__file__).parent / "helpers" / "drill-3-preemptions.jsonl"
DRILL_DOWN_S = [19.73, 18.65, 23.32]  # warning (signal_forwarded) -> first_step_at of the next run
DRILL_WALL_S = 91.39  # started -> finished


def drill_events() -> list[dict]:
    return [json.loads(line) for line in DRILL_LOG.read_text().splitlines()]


def test_warnings_are_placed_at_the_step_the_ranks_agreed_on():
    tl = build_timeline(drill_events())
    assert [[s for _, s in r.warnings] for r in tl.runs] == [[26], [50], [56], []]
    forwarded = [e["time"] for e in drill_events() if e["event"] == "signal_forwarded"]
    assert [r.warnings[0][0] for r in tl.runs[:3]] == forwarded  # drawn when the warning arrived


def test_down_time_is_measured_from_the_warning_to_the_first_resumed_step():
    cost = preemption_cost(drill_events())
    assert cost is not None and [i.kind for i in cost.interruptions] == ["preempt"] * 3
    assert [i.down_s for i in cost.interruptions] == pytest.approx(DRILL_DOWN_S, abs=0.01)
    assert [i.step for i in cost.interruptions] == [26, 50, 56]
    assert cost.lost_s == 0 and all(i.lost_steps == 0 for i in cost.interruptions)  # each warned save committed
    assert cost.wall_s == pytest.approx(DRILL_WALL_S, abs=0.01)
    assert cost.fraction == pytest.approx(sum(DRILL_DOWN_S) / DRILL_WALL_S, abs=0.001)


def test_unwarned_failure_costs_its_work_since_the_last_commit_and_its_restart():
    cost = preemption_cost(example_events(t0=0.0))
    assert cost is not None and [i.kind for i in cost.interruptions] == ["preempt", "failed", "preempt"]
    # warnings at 900 and 2650 s, failure at 1790 s; the next runs restored at 1008, 1818, 2768 s
    assert [i.down_s for i in cost.interruptions] == pytest.approx([108, 28, 118])
    assert [i.lost_s for i in cost.interruptions] == pytest.approx([0, 1790 - 1608, 0])
    assert cost.interruptions[1].lost_steps > 0 and cost.interruptions[1].lost_estimated
    assert cost.down_s + cost.lost_s == pytest.approx(108 + 28 + 118 + 182)
    assert cost.wall_s == pytest.approx(3401)


def test_lost_steps_are_exact_when_an_event_names_the_step_a_failed_run_reached():
    events = [{"time": 0.0, "event": "started"}, {"time": 10.0, "event": "save_committed", "step": 100},
              {"time": 40.0, "event": "hang", "step": 130, "ranks": [1]},
              {"time": 41.0, "event": "started"}, {"time": 50.0, "event": "restored", "step": 100},
              {"time": 53.0, "event": "resumed", "first_step_at": 52.5, "step": 101}]
    cost = preemption_cost(events)
    assert cost is not None
    (hang,) = cost.interruptions
    assert (hang.kind, hang.lost_s, hang.lost_steps, hang.lost_estimated) == ("hang", 30.0, 30, False)
    assert hang.down_s == pytest.approx(12.5)  # the hang's kill (40 s) to the first resumed step (52.5 s)
    assert cost.wall_s == pytest.approx(53)  # still running: to the newest event...
    assert preemption_cost(events, now=100.0).wall_s == pytest.approx(100)  # ...or to now


def test_plot_draws_warnings_down_times_and_title_from_the_measured_log():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from slurmresume.tools.plot import render_timeline

    events = drill_events()
    t0 = events[0]["time"]
    fig = render_timeline(events)
    try:
        ax = fig.axes[0]
        warns = [(float(ln.get_xdata()[0]), float(ln.get_ydata()[0])) for ln in ax.lines if ln.get_marker() == "v"]
        forwarded = [e["time"] - t0 for e in events if e["event"] == "signal_forwarded"]
        assert [s for _, s in warns] == [26, 50, 56]
        assert [x for x, _ in warns] == pytest.approx(forwarded)
        downs = [t.get_text() for t in ax.texts if t.get_text().startswith("down")]
        assert downs == ["down\n19.7s", "down\n18.6s", "down\n23.3s"]
        bands = [(p.get_x(), p.get_x() + p.get_width()) for p in ax.patches if p.get_facecolor()[:3] != (1, 0, 0)]
        resumed = [e["first_step_at"] - t0 for e in events if e["event"] == "resumed"]
        assert bands == [pytest.approx(b, abs=0.01) for b in zip(forwarded, resumed)]
        assert ax.get_xlabel() == "wall-clock time since the first event (seconds)"
        title = ax.get_title()
        assert "3 requeue(s), 0 failure(s)" in title
        assert "down 19.7s + 18.6s + 23.3s, work lost 0.0s: 68% of 1m 31s wall time" in title
    finally:
        plt.close(fig)


def test_plot_title_names_the_lost_work_of_a_failure():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from slurmresume.tools.plot import render_timeline

    fig = render_timeline(example_events(t0=0.0))
    try:
        ax = fig.axes[0]
        assert "work lost 3m 2s (~" in ax.get_title() and "1 failure(s)" in ax.get_title()
        assert any(t.get_text().startswith("failed: lost 3m 2s, ~") for t in ax.texts)
        assert [t.get_text() for t in ax.texts if t.get_text().startswith("down")] == [
            "down\n1m 48s", "down\n28.0s", "down\n1m 58s"]
    finally:
        plt.close(fig)


def test_status_headline_and_json_carry_the_preemption_cost(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)
    write_events(tmp_path / "root", drill_events())
    env = {"COLUMNS": "120", "NO_COLOR": "1", "TERM": "dumb", "SLURMRESUME_CKPT_DIR": ""}
    r = CliRunner().invoke(app, ["status", "-d", str(tmp_path / "root")], env=env)
    assert r.exit_code == 0, r.output
    assert "interruptions: down 19.7s + 18.6s + 23.3s, work lost 0.0s: 68% of 1m 31s wall time" in r.stdout
    r = CliRunner().invoke(app, ["status", "-d", str(tmp_path / "root"), "--json"], env=env)
    cost = json.loads(r.stdout)["preemption_cost"]
    assert [i["down_s"] for i in cost["interruptions"]] == pytest.approx(DRILL_DOWN_S, abs=0.01)
    assert cost["fraction"] == pytest.approx(sum(DRILL_DOWN_S) / DRILL_WALL_S, abs=0.001)
    assert cost["lost_s"] == 0 and cost["wall_s"] == pytest.approx(DRILL_WALL_S, abs=0.01)


def test_status_without_interruptions_has_no_cost(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)
    events = [e for e in example_events() if e["time"] < example_events()[0]["time"] + 800]
    write_events(tmp_path / "root", events)
    assert status.compute_status(tmp_path / "root").preemption_cost is None


def test_two_nodes_log_one_run_per_restart_and_the_first_resumed_step():
    """Every node's launcher logs `started`, relays the warning and logs `resumed`: one run, one
    warning, and the down time ends at the first node's first step."""
    def node_pair(t: float, name: str, **f) -> list[dict]:
        return [{"time": t + 0.2 * n, "event": name, "node": n, "nodes": 2, **f} for n in (0, 1)]

    events = [*node_pair(0.0, "started", restart=0), {"time": 10.0, "event": "save_committed", "step": 10},
              *node_pair(20.0, "signal_forwarded"), {"time": 20.5, "event": "signal_agreed", "step": 21},
              {"time": 21.0, "event": "save_committed", "step": 21},
              {"time": 22.0, "event": "requeued", "restart": 1},
              *node_pair(40.0, "started", restart=1), {"time": 50.0, "event": "restored", "step": 21},
              {"time": 51.0, "event": "resumed", "node": 1, "first_step_at": 50.6, "step": 22},
              {"time": 51.1, "event": "resumed", "node": 0, "first_step_at": 50.7, "step": 22},
              {"time": 60.0, "event": "finished", "step": 30}]
    tl = build_timeline(events)
    assert [r.start for r in tl.runs] == [0.0, 40.0] and [r.warnings for r in tl.runs] == [[(20.0, 21)], []]
    cost = preemption_cost(events)
    assert cost is not None and [i.down_s for i in cost.interruptions] == pytest.approx([30.6])


def test_warned_run_whose_save_failed_counts_the_work_since_the_last_commit():
    events = [{"time": 0.0, "event": "started"}, {"time": 10.0, "event": "save_committed", "step": 10},
              {"time": 30.0, "event": "signal_agreed", "step": 40},
              {"time": 31.0, "event": "emergency_save_failed", "step": 40, "error": "ENOSPC"},
              {"time": 32.0, "event": "requeued"}, {"time": 50.0, "event": "started"},
              {"time": 60.0, "event": "restored", "step": 10}, {"time": 61.0, "event": "save_committed", "step": 11}]
    cost = preemption_cost(events)
    assert cost is not None
    (it,) = cost.interruptions
    assert (it.kind, it.down_s, it.lost_s, it.lost_steps, it.lost_estimated) == ("preempt", 30.0, 22.0, 30, False)


def test_a_requeue_not_resumed_yet_is_down_until_now():
    """While the restart waits or starts up, `status` counts the down time up to now."""
    events = drill_events()
    cut = max(i for i, e in enumerate(events) if e["event"] == "started")  # the 3rd restart: not stepped yet
    warning = [e["time"] for e in events if e["event"] == "signal_forwarded"][-1]
    now = events[cut]["time"] + 5.0
    cost = preemption_cost(events[:cut + 1], now=now)
    assert cost is not None
    last = cost.interruptions[-1]
    assert (last.resumed_at, last.ongoing) == (None, True) and last.down_s == pytest.approx(now - warning)
    assert cost.down_s == pytest.approx(sum(DRILL_DOWN_S[:2]) + now - warning, abs=0.01)
    assert cost.wall_s == pytest.approx(now - events[0]["time"])
    assert cost_line(cost).startswith(f"down 19.7s + 18.6s + {now - warning:.1f}s (still down)")
    waiting = preemption_cost(events[:cut], now=now)  # requeued, the next run not started yet
    assert waiting is not None and waiting.interruptions[-1].down_s == pytest.approx(now - warning)
    gave_up = [{"time": 0.0, "event": "started"}, {"time": 5.0, "event": "save_committed", "step": 5},
               {"time": 9.0, "event": "failed"}, {"time": 9.0, "event": "gave_up"}]
    assert preemption_cost(gave_up, now=100.0).interruptions[0].down_s is None  # the end, not a wait


def test_plot_of_a_run_still_down_draws_the_band_to_now():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from slurmresume.tools.plot import render_timeline

    events = drill_events()
    cut = max(i for i, e in enumerate(events) if e["event"] == "started")
    now = events[cut]["time"] + 5.0
    warning = [e["time"] for e in events if e["event"] == "signal_forwarded"][-1]
    fig = render_timeline(events[:cut + 1], now)
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.texts if t.get_text().startswith("down")][-1] == (
            f"down\n{now - warning:.1f}s\n(still)")
        band = [p for p in ax.patches if p.get_facecolor()[:3] != (1, 0, 0)][-1]
        assert band.get_x() + band.get_width() == pytest.approx(now - events[0]["time"])
    finally:
        plt.close(fig)


def test_a_resubmission_after_giving_up_is_neither_down_time_nor_wall_time():
    """A run that gave up, resubmitted by hand an hour later: the hour is nobody's down time."""
    events = [{"time": 0.0, "event": "started"}, {"time": 10.0, "event": "save_committed", "step": 10},
              {"time": 20.0, "event": "run_ended", "outcome": "failed"}, {"time": 20.0, "event": "failed"},
              {"time": 20.0, "event": "gave_up", "reason": "--max-failures 0 is used up"},
              {"time": 3620.0, "event": "submitted"}, {"time": 3630.0, "event": "started"},
              {"time": 3640.0, "event": "restored", "step": 10}, {"time": 3650.0, "event": "save_committed", "step": 20},
              {"time": 3660.0, "event": "finished", "step": 20}]
    cost = preemption_cost(events, now=4000.0)
    assert cost is not None
    (failed,) = cost.interruptions
    assert (failed.down_s, failed.lost_s, failed.ongoing) == (None, pytest.approx(10.0), False)
    assert cost.wall_s == pytest.approx(20.0 + 30.0)  # the two stretches the job was in flight

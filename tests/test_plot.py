"""`status --plot`: the timeline of a run with 2 preemptions and 1 failure."""

from __future__ import annotations

import pytest
from helpers.timeline import example_events, write_events
from typer.testing import CliRunner

from slurmresume.cli import app
from slurmresume.tools import status
from slurmresume.tools.plot import build_timeline


def test_timeline_runs_and_lost_work():
    tl = build_timeline(example_events(t0=0.0))
    assert [r.end_kind for r in tl.runs] == ["preempt", "failed", "preempt", "finished"]
    assert [r.start_step for r in tl.runs] == [0, 892, 1492, 2324]
    assert len(tl.requeues) == 2 and len(tl.runs[0].warnings) == 1
    from slurmresume.tools.plot import _lost

    _lost(tl)
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

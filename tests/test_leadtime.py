"""--signal-lead against the measured saves: the pure prediction, `status`, and `submit`'s warning."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.core import tiny_state
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.cli import app
from slurmresume.events import append_event
from slurmresume.job import leadtime
from slurmresume.tools import status
from slurmresume.tools.doctor import check_lead

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"
GB = 10**9


def ev(name: str, t: float, **fields) -> dict:
    return {"event": name, "time": t, **fields}


@pytest.mark.parametrize(
    ("saves", "size_now", "expected"),
    [
        ([], None, None),
        ([(4.0, None)], None, 4.0),  # no sizes logged: the slowest save
        # newest size (1 GB) at the slowest rate (3 s per GB above the 1 s fixed part)
        ([(4.0, 2 * GB), (2.0, 1 * GB)], None, 1.0 + 1.5),
        ([(4.0, 2 * GB)], 8 * GB, 16.0),  # the state grew: priced at its new size
        ([(1.0, 1 * GB), (1.0, 1 * GB), (9.0, 1 * GB)], None, 9.0),  # one slow hour counts
    ],
)
def test_predict_save(saves: list, size_now: int | None, expected: float | None) -> None:
    events = [ev("save_committed", i, seconds=s, **({"bytes": b} if b else {})) for i, (s, b) in enumerate(saves)]
    pred = leadtime.predict_save(events, size_now)
    assert (pred.save_s if pred else None) == pytest.approx(expected) if expected is not None else pred is None


def test_required_lead_is_the_one_doctor_uses() -> None:
    assert leadtime.required_lead(20.0, 1.0) == 2 * 20 + 1 + leadtime.MARGIN_S
    need = leadtime.required_lead(20.0, 1.0)
    assert check_lead(int(need) - 1, [20.0], 1.0).status == "warn"
    assert check_lead(int(need) + 1, [20.0], 1.0).status == "ok"


def test_late_emergency_save_is_measured_from_the_signal() -> None:
    events = [ev("submitted", 0, signal_lead=30), ev("started", 1), ev("signal_forwarded", 100),
              ev("save_committed", 135, step=7, seconds=20.0, reason="preempt"),  # 35 s after the signal
              ev("started", 200), ev("save_committed", 300, step=9, seconds=29.0, reason="periodic"),
              ev("signal_agreed", 400), ev("save_committed", 410, step=11, seconds=10.0, reason="preempt")]
    late = leadtime.late_saves(events)
    assert [(x.step, x.seconds, x.lead_s) for x in late] == [(7, 35.0, 30)]


def _root_with_slow_save(tmp_path: Path, lead: int) -> Path:
    root = tmp_path / "run"
    ck = Checkpointer(root, handle_signals=False)
    ck.save(5, tiny_state(5))
    ck.close()
    nbytes = sum(p.stat().st_size for p in (root / "step_000000005").glob("rank-*.safetensors"))  # the shards (not the index files)
    append_event(root, "submitted", job="123", signal_lead=lead)
    append_event(root, "signal_forwarded", signal="SIGUSR1")
    append_event(root, "save_committed", step=6, seconds=45.0, bytes=nbytes, reason="preempt")
    return root


def test_status_flags_a_save_slower_than_the_lead_and_shows_the_margin(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)
    root = _root_with_slow_save(tmp_path, lead=30)
    st = status.compute_status(root)
    assert st.lead is not None and st.lead.lead_s == 30
    assert st.lead.predicted_save_s == pytest.approx(45.0, rel=0.01)
    assert st.lead.margin_s is not None and st.lead.margin_s < -60  # needs >= 100 s
    assert any("emergency save of step 6 took 45.0 s" in w and "--signal-lead 30 s" in w for w in st.warnings)
    assert any("submit with --signal-lead" in w for w in st.warnings)
    data = st.to_json()
    assert data["lead"]["late"][0]["step"] == 6 and data["health"] == "warning"
    out = CliRunner().invoke(app, ["status", "-d", str(root)], env={"COLUMNS": "200"}).stdout
    assert "lead: predicted emergency save" in out and "margin -" in out


def test_status_with_a_long_enough_lead_is_quiet(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)
    root = _root_with_slow_save(tmp_path, lead=600)
    st = status.compute_status(root)
    assert st.lead is not None and st.lead.margin_s is not None and st.lead.margin_s > 0
    assert not [w for w in st.warnings if "lead" in w]


def test_submit_warns_in_one_line_when_the_lead_is_short(tmp_path: Path) -> None:
    root = _root_with_slow_save(tmp_path, lead=30)
    res = CliRunner().invoke(app, ["submit", str(EXAMPLE), "--ckpt-dir", str(root), "--signal-lead", "30",
                                   "--dry-run"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    lines = [x for x in res.stderr.splitlines() if "--signal-lead" in x]
    assert len(lines) == 1 and lines[0].startswith("warning: --signal-lead 30 s is shorter than")
    assert "submit with --signal-lead" in lines[0]
    ok = CliRunner().invoke(app, ["submit", str(EXAMPLE), "--ckpt-dir", str(root), "--signal-lead", "900",
                                  "--dry-run"], env={"COLUMNS": "200"})
    assert ok.exit_code == 0 and "warning" not in ok.stderr

"""status.compute_status and verify_checkpoints on real files; Slurm faked at the one seam."""

from __future__ import annotations

import json
import math
import os
import socket
from pathlib import Path

import numpy as np
import pytest
from helpers.core import rewrite_manifest, tiny_state

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import INPROGRESS, LOCK, step_dir_name
from slurmresume.errors import ConfigError, NoCheckpointError, SlurmError
from slurmresume.events import append_event
from slurmresume.tools import status
from slurmresume.tools.status import SLURM_NOT_FOUND, compute_status, run_slurm, verify_checkpoints

SCHEMA_KEYS = {"schema", "verdict", "root", "now", "health", "problems", "warnings", "slurm", "job", "requeues",
               "event_counts", "history", "checkpoints", "newest_complete", "best", "ranks", "last_hang",
               "lead", "writer", "preemption_cost", "mirror"}
ROW_KEYS = {"step", "name", "path", "state", "created", "age_seconds", "bytes", "shards", "verified",
            "metrics", "newest", "best", "problem"}
JOB_KEYS = {"job_id", "state", "reason", "elapsed", "exit_code", "source", "runs"}


def save(root: Path, *steps: int, **metrics_of) -> None:
    ckpt = Checkpointer(root, handle_signals=False)
    for s in steps:
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0 / (s + 1), "acc": s / 100})
    ckpt.close()


class FakeSlurm:
    """Stands in for `status.run_slurm`: answers by command name, records every call."""

    def __init__(self, squeue: str | None = "", sacct: str | Exception = "", installed: bool = True):
        self.answers = {"squeue": squeue, "sacct": sacct}
        self.installed, self.calls = installed, []

    def __call__(self, args, timeout=10.0):
        self.calls.append(args)
        if not self.installed:
            return None
        if "--version" in args:
            return "slurm 22.05.8\n"
        answer = self.answers[args[0]]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.fixture
def no_slurm(monkeypatch):
    fake = FakeSlurm(installed=False)
    monkeypatch.setattr(status, "run_slurm", fake)
    return fake


def test_states_newest_and_best(tmp_path, no_slurm):
    save(tmp_path, 9, 10, 100)
    (tmp_path / step_dir_name(200)).mkdir()
    busy = tmp_path / step_dir_name(300)
    busy.mkdir()
    (busy / INPROGRESS).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": 0}))
    rewrite_manifest(tmp_path / step_dir_name(9), lambda m: m["shards"][0].update(bytes=12345))
    st = compute_status(tmp_path, best_metric="acc", mode="max")
    rows = {r.step: r for r in st.checkpoints}
    assert [r.step for r in st.checkpoints] == [300, 200, 100, 10, 9]
    assert {s: r.state for s, r in rows.items()} == {300: "being_written", 200: "incomplete", 100: "complete",
                                                      10: "complete", 9: "corrupt"}
    assert rows[100].newest and not rows[10].newest and st.newest_complete == 100
    assert rows[100].best and st.best == {"metric": "acc", "mode": "max", "step": 100, "value": 1.0}
    assert rows[100].shards == 1 and rows[100].bytes > 0 and rows[100].verified is None
    assert rows[100].metrics == {"loss": pytest.approx(1 / 101), "acc": 1.0}
    assert st.health == "error" and any("step_000000009" in p for p in st.problems)
    assert any("1 incomplete directory (step_000000200)" in w for w in st.warnings)
    assert st.slurm == {"available": False, "note": SLURM_NOT_FOUND}


def test_best_min_default_and_missing_metric(tmp_path, no_slurm):
    save(tmp_path, 1, 2, 3)
    assert compute_status(tmp_path, best_metric="loss").best["step"] == 3
    with pytest.raises(ConfigError, match="metric 'bleu'.*acc, loss"):
        compute_status(tmp_path, best_metric="bleu")
    with pytest.raises(ConfigError, match="--mode"):
        compute_status(tmp_path, mode="median")


def test_missing_root(tmp_path, no_slurm):
    with pytest.raises(ConfigError, match="does not exist"):
        compute_status(tmp_path / "nope")


def test_healthy_run_and_json_schema(tmp_path, no_slurm):
    save(tmp_path, 1, 2)
    st = compute_status(tmp_path)
    assert st.health == "ok", (st.problems, st.warnings)
    data = json.loads(json.dumps(st.to_json(), allow_nan=False))
    assert set(data) == SCHEMA_KEYS and data["schema"] == "slurmresume.tools.status/1"
    assert set(data["job"]) == JOB_KEYS and set(data["slurm"]) == {"available", "note"}
    assert all(set(r) == ROW_KEYS for r in data["checkpoints"])
    assert all(key in status.__doc__ for key in SCHEMA_KEYS | ROW_KEYS | JOB_KEYS)  # documented


def test_json_survives_non_finite_metrics(tmp_path, no_slurm):
    metrics = {"loss": math.nan, "t": (1, 2), "acc": np.float32(0.5), "n": np.int64(7)}
    Checkpointer(tmp_path, handle_signals=False).save(1, tiny_state(1), metrics=metrics)
    data = compute_status(tmp_path).to_json()
    assert json.loads(json.dumps(data, allow_nan=False))["checkpoints"][0]["metrics"] == {
        "loss": "nan", "t": [1, 2], "acc": 0.5, "n": 7}


def test_empty_root_warns(tmp_path, no_slurm):
    st = compute_status(tmp_path)
    assert st.checkpoints == [] and st.health == "warning"
    assert any("no complete checkpoint" in w for w in st.warnings)


def test_world_writable_root_and_odd_lock_warn(tmp_path, no_slurm):
    save(tmp_path, 1)
    os.chmod(tmp_path, 0o777)
    (tmp_path / LOCK).unlink(missing_ok=True)
    (tmp_path / LOCK).symlink_to(tmp_path / "elsewhere")
    st = compute_status(tmp_path)
    assert any("world-writable (mode 777)" in w and "chmod o-w" in w for w in st.warnings)
    assert any("lock file" in w for w in st.warnings)


def test_verify_flag_detects_a_flipped_byte(tmp_path, no_slurm):
    save(tmp_path, 1, 2)
    shard = tmp_path / step_dir_name(2) / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    rows = {r.step: r for r in compute_status(tmp_path, verify=True).checkpoints}
    assert rows[1].verified is True and rows[2].verified is False
    assert "rank-00000-of-00001.safetensors" in rows[2].problem


def test_events_history_requeues_and_job_id(tmp_path, monkeypatch, no_slurm):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    for kind, fields in [("submitted", {}), ("started", {}), ("signal_agreed", {"step": 5, "kind": "preempt"}),
                         ("save_committed", {"step": 5, "seconds": 0.5, "reason": "preempt"}),
                         ("exit_after_save", {"step": 5}), ("requeued", {}), ("started", {}), ("requeued", {})]:
        append_event(tmp_path, kind, **fields)
    monkeypatch.setenv("SLURM_JOB_ID", "1")
    append_event(tmp_path, "requeued")  # another job's requeue is not this job's
    st = compute_status(tmp_path, history_limit=3)
    assert st.job.job_id == "1" and st.requeues == 1
    st = compute_status(tmp_path, job_id="4242", history_limit=3)
    assert st.requeues == 2 and [e["event"] for e in st.history] == ["started", "requeued", "requeued"]
    assert st.event_counts["requeued"] == 3 and st.event_counts["save_committed"] == 1


def test_failed_last_event_is_an_error(tmp_path, no_slurm):
    save(tmp_path, 1)
    append_event(tmp_path, "gave_up", reason="too many requeues")
    assert compute_status(tmp_path).health == "error"


def test_last_save_failed_warns(tmp_path, no_slurm):
    save(tmp_path, 1)
    append_event(tmp_path, "save_failed", step=2, error="disk full")
    st = compute_status(tmp_path)
    assert any("disk full" in w for w in st.warnings)


# -- Slurm at the seam --------------------------------------------------------------------------

SACCT = "77|REQUEUED|00:01:00|vm|0:0\n77|RUNNING|00:00:30|vm|0:0\n"


def test_running_job_from_squeue(tmp_path, monkeypatch):
    fake = FakeSlurm(squeue="77|RUNNING|0:30|vm|None\n", sacct=SACCT)
    monkeypatch.setattr(status, "run_slurm", fake)
    st = compute_status(tmp_path, job_id="77")
    assert (st.job.state, st.job.source, st.job.runs, st.job.elapsed) == ("RUNNING", "squeue", 2, "0:30")
    assert st.slurm == {"available": True, "note": None}
    assert ["squeue", "-h", "-j", "77", "-o", "%i|%T|%M|%N|%r"] in fake.calls


def test_finished_job_from_sacct(tmp_path, monkeypatch):
    fake = FakeSlurm(squeue=SlurmError("squeue: Invalid job id specified"),
                     sacct="77|REQUEUED|00:01:00|vm|0:0\n77|FAILED|00:00:30|vm|1:0\n")
    monkeypatch.setattr(status, "run_slurm", fake)
    st = compute_status(tmp_path, job_id="77")
    assert (st.job.state, st.job.source, st.job.exit_code) == ("FAILED", "sacct", "1:0")
    assert st.health == "error" and any("FAILED" in p for p in st.problems)


def test_sacct_without_accounting_is_a_note(tmp_path, monkeypatch):
    fake = FakeSlurm(squeue="77|PENDING|0:00||Priority\n", sacct=SlurmError("accounting storage is disabled"))
    monkeypatch.setattr(status, "run_slurm", fake)
    st = compute_status(tmp_path, job_id="77")
    assert st.job.state == "PENDING" and st.job.reason == "Priority"
    assert "accounting storage is disabled" in st.slurm["note"]


def test_unknown_job_and_no_job(tmp_path, monkeypatch):
    monkeypatch.setattr(status, "run_slurm", FakeSlurm(squeue="", sacct=""))
    assert "not known" in compute_status(tmp_path, job_id="5").slurm["note"]
    assert "pass --job" in compute_status(tmp_path).slurm["note"]


def test_no_slurm_still_shows_checkpoints(tmp_path, no_slurm):
    save(tmp_path, 3)
    st = compute_status(tmp_path, job_id="77")
    assert st.slurm["note"] == SLURM_NOT_FOUND and st.job.state is None
    assert [r.step for r in st.checkpoints] == [3]
    assert all(call[0] == "squeue" for call in no_slurm.calls)


def test_the_real_seam(tmp_path, monkeypatch):
    assert run_slurm(["definitely-not-a-slurm-command-xyz"]) is None
    assert run_slurm(["true"]) == ""
    with pytest.raises(SlurmError, match="failed"):
        run_slurm(["false"])
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "squeue").write_text("#!/bin/sh\nsleep 5\n")
    (fake_bin / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{os.environ['PATH']}")
    with pytest.raises(SlurmError, match="did not answer"):
        run_slurm(["squeue", "--version"], timeout=0.2)


# -- verify_checkpoints -------------------------------------------------------------------------

def test_verify_default_step_and_all(tmp_path):
    save(tmp_path, 1, 2, 3)
    (tmp_path / step_dir_name(4)).mkdir()
    assert [(r.step, r.ok) for r in verify_checkpoints(tmp_path)] == [(3, True)]
    assert [(r.step, r.ok) for r in verify_checkpoints(tmp_path, step=2)] == [(2, True)]
    assert [r.step for r in verify_checkpoints(tmp_path, every=True)] == [3, 2, 1]


def test_verify_names_each_bad_file(tmp_path):
    save(tmp_path, 1, 2)
    shard = tmp_path / step_dir_name(1) / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    (tmp_path / step_dir_name(2) / "rank-00000-of-00001.safetensors").write_bytes(b"short")
    results = {r.step: r for r in verify_checkpoints(tmp_path, every=True)}
    assert not results[1].ok and "fails its checksum" in results[1].problems[0] and str(shard) in results[1].problems[0]
    assert not results[2].ok and "rank-00000-of-00001.safetensors" in results[2].problems[0]


def test_verify_errors(tmp_path):
    with pytest.raises(NoCheckpointError, match="no complete checkpoint"):
        verify_checkpoints(tmp_path)
    with pytest.raises(NoCheckpointError, match="no complete checkpoint"):
        verify_checkpoints(tmp_path, every=True)
    (tmp_path / step_dir_name(4)).mkdir()
    with pytest.raises(NoCheckpointError, match="incomplete"):
        verify_checkpoints(tmp_path, step=4)
    with pytest.raises(NoCheckpointError, match="no step 5"):
        verify_checkpoints(tmp_path, step=5)
    with pytest.raises(ConfigError, match="does not exist"):
        verify_checkpoints(tmp_path / "nope")

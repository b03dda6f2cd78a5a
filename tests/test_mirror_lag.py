"""`status` on a local root asks the run's mirror how far behind it is (#30): the bucket's
newest committed step against the newest local one, uploads in flight, the last error; a
bucket behind is AT RISK, also after "finished". Against the real S3 server (helpers/objstore)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture
from helpers.tcpproxy import Down, Proxy
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.cli import app
from slurmresume.tools.health import bucket_lag, mirror_url


@pytest.mark.parametrize(("local", "age", "bucket", "uploading", "want"), [
    (None, None, None, False, None),  # nothing committed locally
    (5, 999.0, 5, False, None),  # level
    (5, 999.0, 7, False, None),  # the bucket ahead (a lost root being restored)
    (5, 999.0, 3, False, "problem"),
    (5, 999.0, None, False, "problem"),  # nothing ever reached the bucket
    (5, 999.0, 3, True, "warning"),  # the step's upload is in flight
    (5, 10.0, 3, False, "warning"),  # committed 10 s ago, inside the grace
])
def test_bucket_lag_table(local, age, bucket, uploading, want) -> None:
    got = bucket_lag("s3://b/p", local, age, bucket, uploading, grace_s=240.0)
    assert (got[0] if got else None) == want, got
    if got:
        assert f"step {local}" in got[1] and "s3://b/p" in got[1]


def test_mirror_url_from_the_log() -> None:
    assert mirror_url([]) is None
    assert mirror_url([{"event": "mirror_uploaded", "url": "s3://b/run/step_000000002"}]) == "s3://b/run"
    assert mirror_url([{"event": "mirror_uploaded", "url": "s3://b/step_000000002"}]) == "s3://b"
    assert mirror_url([{"event": "mirror_behind", "url": "s3://b/x"}, {"event": "save_committed", "step": 1}]) == "s3://b/x"


def test_a_finished_run_whose_bucket_is_behind_is_at_risk() -> None:
    from slurmresume.tools.health import judge

    lag = bucket_lag("s3://b/p", 2, 999.0, 1, False, 240.0)
    assert lag is not None and lag[0] == "problem"
    events = [{"event": "started", "time": 1.0}, {"event": "finished", "step": 2, "time": 2.0}]
    h = judge(events, [], slurm_state=None, job_id=None, interval_s=None, problems=[lag[1]], now=3.0)
    assert h.verdict == "at_risk" and "lacks step 2" in h.reason, h
    h = judge(events, [], slurm_state=None, job_id=None, interval_s=None, problems=[], now=3.0)
    assert h.verdict == "finished", h


def status(root: Path, *extra: str) -> tuple[int, dict]:
    out = CliRunner().invoke(app, ["status", "--json", "--ckpt-dir", str(root), *extra], env={"COLUMNS": "200"})
    return out.exit_code, json.loads(out.stdout)


def test_local_status_asks_the_bucket_and_a_bucket_behind_is_at_risk(s3, tmp_path: Path, monkeypatch) -> None:
    """Step 1 reached the bucket, step 2 was committed by a run without the mirror: the log
    holds no failure at all, only the bucket tells. AT RISK (exit 3) naming both steps; the
    JSON has the bucket's side; --no-mirror-check stays off the network (the old answer)."""
    url, root = unique_url(), tmp_path / "root"
    with Checkpointer(root, handle_signals=False, mirror=url) as ckpt:
        ckpt.save(1, {"w": torch.arange(4.0)})
    with Checkpointer(root, handle_signals=False) as ckpt:
        ckpt.save(2, {"w": torch.arange(4.0) + 1})
    monkeypatch.setenv("SLURMRESUME_MIRROR_CLOSE_DEADLINE", "1")  # the grace for an upload to land
    time.sleep(1.2)
    code, data = status(root)
    assert code == 3 and data["verdict"]["verdict"] == "at_risk", data["verdict"]
    assert "lacks step 2" in data["verdict"]["reason"] and "newest committed" in data["verdict"]["reason"]
    m = data["mirror"]
    assert (m["url"], m["newest_local"], m["newest_in_bucket"], m["uploads_in_flight"], m["behind"]) == \
        (url, 2, 1, 0, True), m
    code, data = status(root, "--no-mirror-check")
    assert code == 0 and data["mirror"] is None, data["verdict"]
    shown = CliRunner().invoke(app, ["status", "--ckpt-dir", str(root)], env={"COLUMNS": "200"})
    assert shown.exit_code == 3 and "newest committed there 1, here 2" in shown.stdout, shown.stdout
    with Checkpointer(root, handle_signals=False, mirror=url) as ckpt:  # a run with the mirror catches up
        assert ckpt.restore({"w": torch.zeros(4)}) == 2
    code, data = status(root)
    assert code == 0 and data["mirror"]["newest_in_bucket"] == 2 and data["mirror"]["behind"] is False, data


def test_a_mirror_that_never_answers_is_a_warning_within_its_timeouts(s3, tmp_path: Path, monkeypatch) -> None:
    url, root = unique_url(), tmp_path / "root"
    with Checkpointer(root, handle_signals=False, mirror=url) as ckpt:
        ckpt.save(1, {"w": torch.arange(4.0)})
    proxy = Proxy(int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]), silent=True)
    for name, value in (("AWS_ENDPOINT_URL", proxy.url), ("SLURMRESUME_MIRROR_CONNECT_TIMEOUT", "1"),
                        ("SLURMRESUME_MIRROR_READ_TIMEOUT", "1"), ("SLURMRESUME_MIRROR_ATTEMPTS", "2")):
        monkeypatch.setenv(name, value)
    try:
        started = time.monotonic()
        code, data = status(root)
        took = time.monotonic() - started
    finally:
        proxy.close()
    assert took < 10, f"status took {took:.1f} s against 2 tries of 1 s"
    assert code == 0 and data["mirror"]["error"], data
    assert any("could not ask the mirror" in w for w in data["warnings"]), data["warnings"]
    down = Down()
    monkeypatch.setenv("AWS_ENDPOINT_URL", down.url)
    code, data = status(root)
    assert code == 0 and data["mirror"]["error"] and data["mirror"]["newest_local"] == 1, data

"""The mirror under network faults, against the real S3 server behind a loopback TCP proxy
(helpers/tcpproxy.py): a download cut mid-part is resumed; an endpoint that accepts and
never answers cannot hold `close()` past its deadline."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture
from helpers.tcpproxy import Down, Proxy

from slurmresume import Checkpointer

SHARD = "rank-00000-of-00001.safetensors"


def s3_port(monkeypatch) -> int:
    import os

    return int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])


def big(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(3 << 20, generator=g), "step": step}  # 12 MiB


def test_a_download_cut_mid_part_is_resumed_and_the_restore_succeeds(s3, tmp_path: Path, monkeypatch) -> None:
    url = unique_url()
    ckpt = Checkpointer(tmp_path / "a", handle_signals=False, mirror=url)
    ckpt.save(3, big(3))
    ckpt.close()
    proxy = Proxy(s3_port(monkeypatch), cut_after=4 << 20)  # inside the 12 MiB shard's body
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    monkeypatch.setenv("SLURMRESUME_MIRROR_ATTEMPTS", "3")
    try:
        state = {"w": torch.zeros(3 << 20), "step": 0}
        ckpt = Checkpointer(tmp_path / "lost", handle_signals=False, mirror=url)  # the local root is gone
        assert ckpt.restore(state) == 3
        ckpt.close()
    finally:
        proxy.close()
    assert proxy.cuts == 1
    assert torch.equal(state["w"], big(3)["w"]) and state["step"] == 3


def test_close_returns_within_its_deadline_when_the_endpoint_never_answers(s3, tmp_path: Path, monkeypatch) -> None:
    proxy = Proxy(s3_port(monkeypatch), silent=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    for name, value in (("CONNECT_TIMEOUT", "1"), ("READ_TIMEOUT", "1"), ("ATTEMPTS", "2"), ("CLOSE_DEADLINE", "3")):
        monkeypatch.setenv(f"SLURMRESUME_MIRROR_{name}", value)
    try:
        ckpt = Checkpointer(tmp_path / "r", handle_signals=False, mirror=unique_url())
        ckpt.save(1, {"w": torch.arange(10.0)})
        started = time.monotonic()
        with pytest.raises(SystemExit) as ended:  # the step is not on the bucket: a status of its own
            ckpt.close()
        took = time.monotonic() - started
    finally:
        proxy.close()
    assert proxy.accepted >= 1  # the upload did reach the endpoint
    assert took < 3 + 2, f"close() took {took:.1f} s, its deadline is 3 s"
    assert ended.value.code == 78


BEHIND_SCRIPT = """
import sys, torch
from slurmresume import Checkpointer
ckpt = Checkpointer(sys.argv[1], handle_signals=False, mirror=sys.argv[2])
ckpt.save(1, {"w": torch.arange(4.0)})
try:
    ckpt.close()
finally:
    print("cleaned up")
print("after close")
"""


def test_server_down_at_close_is_a_distinct_exit_and_the_next_run_uploads_the_step(s3, tmp_path: Path,
                                                                                     monkeypatch) -> None:
    import os
    import subprocess
    import sys

    from helpers.objstore import aws_env
    from helpers.procs import REPO, clean_env

    from slurmresume.contract import EXIT_MIRROR_BEHIND
    from slurmresume.events import read_events
    from slurmresume.mirror import parse_s3_url
    from slurmresume.storage import bucketsteps

    url, root = unique_url(), tmp_path / "root"
    down = Down()  # connections refused: the server is down
    env = clean_env(**{**aws_env(), "AWS_ENDPOINT_URL": down.url}, SLURMRESUME_MIRROR_ATTEMPTS="2",
                    SLURMRESUME_MIRROR_CLOSE_DEADLINE="20", PYTHONPATH=os.environ.get("PYTHONPATH", str(REPO)))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", BEHIND_SCRIPT, str(root), url], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == EXIT_MIRROR_BEHIND, (proc.returncode, proc.stderr[-2000:])
    assert time.monotonic() - started < 60
    assert "cleaned up" in proc.stdout and "after close" not in proc.stdout  # SystemExit: finally blocks run
    assert proc.stderr.count("is not on the mirror") == 1 and "Traceback" not in proc.stderr, proc.stderr
    behind = [e for e in read_events(root) if e.get("event") == "mirror_behind"]
    assert behind and behind[-1]["step"] == 1, read_events(root)
    tries = [e for e in read_events(root) if e.get("event") == "mirror_failed"]
    assert len(tries) == 2  # the final upload was tried again before giving up
    loc = parse_s3_url(url)
    assert bucketsteps.find_latest(s3, loc) is None
    ckpt = Checkpointer(root, handle_signals=False, mirror=url)  # the next run, server back
    assert ckpt.restore({"w": torch.zeros(4)}) == 1
    ckpt.close()
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 1 and info.verified


def test_local_status_counts_a_mirror_behind_as_at_risk_until_the_next_run_uploads(s3, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    import json

    from typer.testing import CliRunner

    from slurmresume.cli import app
    from slurmresume.events import try_append_event

    url, root = unique_url(), tmp_path / "root"
    real = os.environ["AWS_ENDPOINT_URL"]
    down = Down()
    monkeypatch.setenv("AWS_ENDPOINT_URL", down.url)
    monkeypatch.setenv("SLURMRESUME_MIRROR_ATTEMPTS", "1")
    ckpt = Checkpointer(root, handle_signals=False, mirror=url)
    ckpt.save(1, {"w": torch.arange(4.0)})
    with pytest.raises(SystemExit):
        ckpt.close()
    try_append_event(root, "finished", step=1)  # what the launcher writes when the script ends

    def status() -> tuple[int, dict]:
        out = CliRunner().invoke(app, ["status", "--json", "--ckpt-dir", str(root)], env={"COLUMNS": "200"})
        return out.exit_code, json.loads(out.stdout)

    code, data = status()
    assert code == 3 and data["verdict"]["verdict"] == "at_risk", data["verdict"]
    assert "mirror" in data["verdict"]["reason"] and "step 1" in data["verdict"]["reason"]
    monkeypatch.setenv("AWS_ENDPOINT_URL", real)  # the server is back: the next run uploads step 1
    ckpt = Checkpointer(root, handle_signals=False, mirror=url)
    assert ckpt.restore({"w": torch.zeros(4)}) == 1
    ckpt.close()
    try_append_event(root, "finished", step=1)
    code, data = status()
    assert code == 0 and data["verdict"]["verdict"] == "finished", data["verdict"]


def test_restore_through_an_endpoint_that_never_answers_fails_within_its_timeouts(s3, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    from slurmresume.errors import CheckpointError

    proxy = Proxy(s3_port(monkeypatch), silent=True)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
    for name, value in (("CONNECT_TIMEOUT", "1"), ("READ_TIMEOUT", "1"), ("ATTEMPTS", "2")):
        monkeypatch.setenv(f"SLURMRESUME_MIRROR_{name}", value)
    try:
        ckpt = Checkpointer(tmp_path / "r", handle_signals=False, mirror=unique_url())
        started = time.monotonic()
        with pytest.raises(CheckpointError, match="cannot be read"):  # empty root: never a silent fresh start
            ckpt.restore({"w": torch.zeros(4)})
        took = time.monotonic() - started
        ckpt.close()
    finally:
        proxy.close()
    assert proxy.accepted >= 1
    assert took < 15, f"restore took {took:.1f} s with 2 tries of 1 s timeouts"


LAUNCHED_SCRIPT = """
import os, torch
from slurmresume import Checkpointer
with Checkpointer() as ckpt:
    state = {"w": torch.zeros(4)}
    start = 0 if os.environ.get("FIRST") else ckpt.restore(state)  # a fresh run needs a reachable mirror
    print("trained from", start, flush=True)
    if start < 1:
        state["w"] = torch.arange(4.0)
        ckpt.save(1, state)
"""


def test_the_launcher_ends_a_run_whose_mirror_is_behind_with_78_and_no_retry(s3, tmp_path: Path) -> None:
    """Server down at close() under `submit --local`: rank 0 exits 78, which torchrun reports as a
    plain failure (1); the launcher reads rank 0's record, does not spend --max-failures on a retry
    that would train nothing, and ends with 78. The next run (server back) uploads the step."""
    import subprocess
    import sys

    from helpers.objstore import aws_env
    from helpers.procs import REPO, clean_env

    from slurmresume.contract import EXIT_MIRROR_BEHIND
    from slurmresume.events import read_events
    from slurmresume.mirror import parse_s3_url
    from slurmresume.storage import bucketsteps

    url, root, script = unique_url(), tmp_path / "root", tmp_path / "train.py"
    script.write_text(LAUNCHED_SCRIPT)
    down = Down()
    base = {**aws_env(), "SLURMRESUME_MIRROR_ATTEMPTS": "1", "SLURMRESUME_MIRROR_CLOSE_DEADLINE": "20",
            "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO))}
    cmd = [sys.executable, "-m", "slurmresume", "submit", "--local", str(script), "--ckpt-dir", str(root),
           "--mirror", url, "--max-failures", "2"]
    proc = subprocess.run(cmd, env=clean_env(**{**base, "AWS_ENDPOINT_URL": down.url, "FIRST": "1"}), cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == EXIT_MIRROR_BEHIND, out[-3000:]
    assert [p.parent.name for p in root.glob("step_*/COMMITTED")] == ["step_000000001"], out[-2000:]
    ev = read_events(root)
    assert [e["event"] for e in ev].count("started") == 1, [e["event"] for e in ev]  # no retry
    ended = [e for e in ev if e["event"] == "run_ended"]
    assert [e["outcome"] for e in ended] == ["mirror_behind"] and ended[0]["action"] == "behind", ended
    assert "not on the mirror" in out and "Traceback" not in out, out[-3000:]
    loc = parse_s3_url(url)
    assert bucketsteps.find_latest(s3, loc) is None
    proc = subprocess.run(cmd, env=clean_env(**base), cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "trained from 1" in proc.stdout + proc.stderr
    info = bucketsteps.find_latest(s3, loc, verify=True)
    assert info is not None and info.step == 1 and info.verified

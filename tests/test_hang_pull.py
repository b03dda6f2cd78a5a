"""Issue #26, the slow mirror pull as a whole run: a restore that pulls its step from the real S3
server (SeaweedFS, `bash scripts/objstore.sh up`) through a throttled loopback link that also
stalls, so the pull lasts longer than the restore floor and its bytes stop arriving for longer
than it. Budgets shortened through the same knobs a user has (JobSpec fields = submit options)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.objstore import aws_env, s3, unique_url  # noqa: F401 - s3 is a fixture
from helpers.procs import HELPERS, clean_env, signal_tree
from helpers.tcpproxy import Proxy

HANG_TRAIN = HELPERS / "hang_train.py"


def _run(root: Path, piddir: Path, steps: int, spec_kw: str, endpoint: str) -> tuple[int | None, str, list[dict]]:
    """`run_local` (the `submit --local` launcher), 2 ranks of hang_train.py with 4 MiB more
    state (BIG=1), saving every 10 steps, mirrored through `endpoint`."""
    code = ("import sys, json; from pathlib import Path; from slurmresume.job.config import JobSpec; "
            "from slurmresume.job.hang import HangBudgets; from slurmresume.job.node import run_local; "
            f"spec = JobSpec(script=Path({str(HANG_TRAIN)!r}), script_args=tuple(sys.argv[1:]), "
            f"ckpt_dir=Path({str(root)!r}), nproc_per_node=2, {spec_kw}); "
            "print(json.dumps(run_local(spec)))")
    env = clean_env(**{**aws_env(), "AWS_ENDPOINT_URL": endpoint, "PIDDIR": str(piddir), "BIG": "1",
                       "PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    proc = subprocess.Popen([sys.executable, "-c", code, str(steps), "0.05", "-1", "1", "0", "10"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
    events = [json.loads(x) for x in (root / "events.jsonl").read_text().splitlines()]
    return proc.returncode, out, events


@pytest.mark.slow
def test_a_slow_stalling_mirror_pull_in_a_whole_run_is_not_a_hang(s3, tmp_path: Path) -> None:  # noqa: F811
    """Run 1 mirrors step 10 (~8.4 MB, 2 ranks) to the bucket. Run 2 starts on an empty root and
    restores it from the bucket through a link of 2 MB/s that stalls 12 s after the first 2 MB:
    the pull takes ~16 s, its bytes stop for 12 s, the restore floor is 8 s (--hang-startup 8,
    --hang-save 2; not less: rank 1 waits in restore while rank 0 loads botocore and lists the
    bucket, seconds on this loaded machine). With --hang-io-rate 1 (a user on a slow link says so)
    the pull's budget scales with its bytes (2 + 3 x 8.4 = 27 s): 0 kills, the run resumes at step
    10 and finishes (the old watch killed the restore at its 8 s floor)."""
    url = unique_url()
    direct = aws_env()["AWS_ENDPOINT_URL"]
    rc, out, ev = _run(tmp_path / "first", tmp_path / "p1", 10, f"mirror={url!r}, max_hangs=0", direct)
    assert rc == 0 and any(e["event"] == "mirror_uploaded" and e["step"] == 10 for e in ev), out[-3000:]

    proxy = Proxy(int(direct.rsplit(":", 1)[1]), rate_bps=2e6, stall=(2_000_000, 12.0))
    try:
        spec = (f"mirror={url!r}, max_hangs=1, hang_io_rate=1, "
                "hang_budgets=HangBudgets(startup_s=8, floor_s=2, save_floor_s=2)")
        rc, out, ev = _run(tmp_path / "second", tmp_path / "p2", 20, spec, proxy.url)
    finally:
        proxy.close()
    assert proxy.stalled, "the link never stalled: the test did not test a pull whose bytes stop"
    pulls = [e for e in ev if e["event"] == "mirror_downloaded"]
    assert [e for e in ev if e["event"] == "hang"] == [] and rc == 0, out[-3000:]
    assert pulls and pulls[0]["step"] == 10 and pulls[0]["seconds"] > 12.0, pulls  # longer than the 8 s floor
    assert [e["step"] for e in ev if e["event"] == "restored"][:1] == [10], out[-3000:]
    assert any(e["event"] == "finished" and e["step"] == 20 for e in ev), out[-3000:]

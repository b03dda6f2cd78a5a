"""Issue #28: the drill is hermetic. With a mirror configured for the real run
([tool.slurmresume] in pyproject.toml, and $SLURMRESUME_MIRROR), a drill keeps both runs under
its --workdir: nothing reaches the object store, so the configured prefix stays as it was.

The object store here is an in-process fake (an HTTP server on loopback that records every
request and answers 404): it proves that no request was made at all, which is stronger than
comparing the prefix's bytes, and it needs no real S3 server. On the old code the runs used the
configured prefix (every restore asked the bucket for its newest step)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers.procs import HELPERS

SCRIPT = HELPERS / "train_drill_cases.py"


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def _any(self) -> None:
        self.seen.append(f"{self.command} {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _any

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.slow
def test_a_drill_leaves_the_configured_mirror_untouched(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (tmp_path / "pyproject.toml").write_text('[tool.slurmresume]\nmirror = "s3://real-bucket/real-run"\n')
        env = {**os.environ, "SLURMRESUME_MIRROR": "s3://real-bucket/also-real", "COLUMNS": "400",
               "AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}", "AWS_ACCESS_KEY_ID": "x",
               "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}
        res = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(SCRIPT), "--workdir",
                              str(tmp_path / "w"), "--preemptions", "1", "--seed", "3", "--json", "--",
                              "--steps", "12", "--case", "unseeded"],
                             capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    finally:
        server.shutdown()
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert _Recorder.seen == []
    # the same drill is test_drill_culprit's never-seeded case (that test runs with --exhaustive):
    # Python's and NumPy's streams, never seeded, are reported and do not fail the drill
    verdict = json.loads(res.stdout[res.stdout.index("{"):])
    assert verdict["ok"] is True
    assert {"rng.python", "rng.numpy"} <= {d["key"] for d in verdict["differences"]}, verdict["differences"]
    assert all(d["hint"].startswith("never seeded") and not d["culprit"] for d in verdict["differences"])
    events = "".join((tmp_path / "w" / run / "events.jsonl").read_text() for run in ("uninterrupted", "preempted"))
    assert "mirror_" not in events

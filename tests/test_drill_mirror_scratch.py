"""Issue #28: `drill --mirror s3://BUCKET/PREFIX` exercises the mirror against a scratch prefix
(BUCKET/slurmresume-drill/<id>/) and never touches PREFIX, here the real run's prefix configured
in [tool.slurmresume]. Against the real S3 server on loopback (scripts/objstore.sh). On the old
code `drill` had no --mirror (usage error, exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.objstore import aws_env, ensure_bucket, unique_url
from helpers.procs import HELPERS, clean_env

from slurmresume.mirror import parse_s3_url
from slurmresume.storage import bucketsteps
from slurmresume.storage.s3 import client

SCRIPT = HELPERS / "train_drill_cases.py"


def snapshot(s3, bucket: str, prefix: str) -> dict[str, bytes]:
    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
            for o in page.get("Contents", [])]
    return {k: s3.get_object(Bucket=bucket, Key=k)["Body"].read() for k in keys}


@pytest.mark.slow  # ~30 s
def test_drill_mirror_uses_a_scratch_prefix_and_leaves_the_given_one_unchanged(tmp_path: Path,
                                                                               monkeypatch) -> None:
    env = aws_env()
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    s3 = client()
    ensure_bucket(s3)
    real = parse_s3_url(unique_url())
    for i in range(3):  # the real run's prefix, with something in it
        s3.put_object(Bucket=real.bucket, Key=f"{real.prefix}/obj{i}", Body=bytes([i]) * (100 + i))
    before = snapshot(s3, real.bucket, real.prefix)
    url = f"s3://{real.bucket}/{real.prefix}"
    (tmp_path / "pyproject.toml").write_text(f'[tool.slurmresume]\nmirror = "{url}"\n')

    res = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(SCRIPT), "--workdir", str(tmp_path / "w"),
                          "--preemptions", "2", "--mirror", url, "--json", "--", "--steps", "8"],
                         cwd=tmp_path, env=clean_env(**env), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    verdict = json.loads(res.stdout[res.stdout.find("{"):])
    assert verdict["ok"] is True and verdict["preemptions"] == 2
    scratch = verdict["mirror"]
    assert scratch.startswith(f"s3://{real.bucket}/slurmresume-drill/"), scratch
    # the mirror was exercised: each run's last step is on the bucket, complete and verified
    for run in ("uninterrupted", "preempted"):
        newest = bucketsteps.find_latest(s3, parse_s3_url(f"{scratch}/{run}"), verify=True)
        assert newest is not None and newest.step == 8 and newest.verified, run
    # and the given (configured) prefix is byte-for-byte what it was
    assert snapshot(s3, real.bucket, real.prefix) == before

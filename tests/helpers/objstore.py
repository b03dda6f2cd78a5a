"""The real S3 server of the mirror tests (`scripts/objstore.sh up`: SeaweedFS on loopback).

`aws_env()` reads the AWS variables that `objstore.sh up` wrote; the tests fail (never skip)
when the server is not answering, as the Slurm tests do for the cluster.
"""

from __future__ import annotations

import functools
import os
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STATE_DIR = Path(os.environ.get("SLURMRESUME_OBJSTORE_DIR", "/var/lib/slurmresume-objstore"))
BUCKET = "slurmresume-test"


@functools.cache
def aws_env() -> dict[str, str]:
    env_file = STATE_DIR / "aws.env"
    status = subprocess.run(["bash", str(REPO / "scripts" / "objstore.sh"), "status"], capture_output=True,
                            text=True, timeout=60)
    if status.returncode != 0 or not env_file.exists():
        pytest.fail("the S3 server is not up (run `bash scripts/objstore.sh up`):\n" + status.stderr[-2000:])
    env = {}
    for line in env_file.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        if key:
            env[key] = value
    return env


def ensure_bucket(s3: object, bucket: str = BUCKET) -> None:
    from botocore.exceptions import ClientError

    try:
        s3.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
    except ClientError as exc:
        if exc.response["Error"]["Code"] not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def unique_url(bucket: str = BUCKET) -> str:
    return f"s3://{bucket}/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch):
    """A boto3 client for the test server (the AWS variables set for the test), bucket created."""
    from slurmresume.mirror.s3 import client

    for key, value in aws_env().items():
        monkeypatch.setenv(key, value)
    c = client()
    ensure_bucket(c)
    return c

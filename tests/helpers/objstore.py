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
    return read_env(env_file)


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
    from slurmresume.storage.s3 import client

    for key, value in aws_env().items():
        monkeypatch.setenv(key, value)
    c = client()
    ensure_bucket(c)
    return c


def read_env(env_file: Path) -> dict[str, str]:
    """The `export KEY=VALUE` lines `objstore.sh up` writes, as a dict."""
    env = {}
    for line in env_file.read_text().splitlines():
        key, _, value = line.removeprefix("export ").partition("=")
        if key:
            env[key] = value
    return env


def _free_port_block() -> int:
    """An S3 port whose whole block of `weed mini` ports (objstore.sh: S3, master, volume, filer,
    admin, and each + 10000 for gRPC) is free on loopback now."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 30000)
        block = [p + d for p in (port, port + 1000, port - 250, port + 555, port + 15313) for d in (0, 10000)]
        try:
            for p in block:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    pytest.fail("no free block of ports for a private S3 server on 127.0.0.1")


class PrivateStore:
    """A SeaweedFS of the test's own, for tests that SIGKILL the server: `scripts/objstore.sh`
    with its own state dir and port (the shared server stays up for every other test)."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self._env = {**os.environ, "SLURMRESUME_OBJSTORE_DIR": str(state_dir),
                     "SLURMRESUME_OBJSTORE_PORT": str(_free_port_block()), "SLURMRESUME_OBJSTORE_TIMEOUT": "180"}

    def _script(self, command: str) -> None:
        proc = subprocess.run(["bash", str(REPO / "scripts" / "objstore.sh"), command], env=self._env,
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            pytest.fail(f"objstore.sh {command} (state in {self.dir}) failed:\n{proc.stderr[-3000:]}")

    def up(self) -> None:
        """Start the server (on the same data after a kill) and return once it answers."""
        self._script("up")

    def aws_env(self) -> dict[str, str]:
        return read_env(self.dir / "aws.env")

    def kill(self) -> None:
        """SIGKILL the server and return once it is gone (a zombie counts as gone: its pid file
        is removed, so that `up` starts a new one)."""
        import signal
        import time

        pidfile = self.dir / "weed.pid"
        pid = int(pidfile.read_text().strip())
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 120  # a hang guard only
        while True:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                break
            if state in ("Z", "X"):
                break
            if time.monotonic() > deadline:
                pytest.fail(f"the S3 server (pid {pid}) outlived SIGKILL for 120 s")
            time.sleep(0.05)
        pidfile.unlink(missing_ok=True)


@pytest.fixture
def private_store(tmp_path_factory: pytest.TempPathFactory):
    """A running `PrivateStore` (SIGKILLed after the test: its data is thrown away)."""
    store = PrivateStore(tmp_path_factory.mktemp("objstore"))
    store.up()
    try:
        yield store
    finally:
        if (store.dir / "weed.pid").exists():
            store.kill()

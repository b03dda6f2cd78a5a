"""The mirror under network faults, against the real S3 server behind a loopback TCP proxy
(helpers/tcpproxy.py): a download cut mid-part is resumed; an endpoint that accepts and
never answers cannot hold `close()` past its deadline."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from helpers.objstore import s3, unique_url  # noqa: F401 - s3 is a fixture
from helpers.tcpproxy import Proxy

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
        ckpt.close()
        took = time.monotonic() - started
    finally:
        proxy.close()
    assert proxy.accepted >= 1  # the upload did reach the endpoint
    assert took < 3 + 2, f"close() took {took:.1f} s, its deadline is 3 s"

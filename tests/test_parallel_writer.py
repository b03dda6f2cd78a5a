"""The `buffered-par` write path (issue #51): PAR_THREADS threads writing ranges of one shard file.
It must write the very bytes the other paths write (readers never change), and a failure in any
one of its streams must fail the save with nothing committed."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import slurmresume
from slurmresume.checkpoint import calibrate, fsio, writer
from slurmresume.checkpoint.store import find_latest
from slurmresume.errors import SaveError

SHARD = "rank-00000-of-00001.safetensors"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path / "cache" / "writer.json"))
    monkeypatch.delenv("SLURMRESUME_NO_ODIRECT", raising=False)
    calibrate._memo.clear()


def _state(seed: int) -> dict[str, torch.Tensor]:
    """Large tensors over several CHUNK ranges, many small ones (one pwritev carries several), odd
    sizes and dtypes: every kind of range the threads split between them."""
    g = torch.Generator().manual_seed(seed)
    state = {"big": torch.randn(writer.CHUNK * 3 // 8 + 1234, generator=g),
             "mid": torch.randn(5_000_003, generator=g).to(torch.bfloat16),
             "ints": torch.arange(7, dtype=torch.int64) + seed}
    state.update({f"ln.{i}": torch.randn(2048 + i, generator=g) for i in range(40)})
    return state


def _save(root: Path, step: int, state: dict[str, torch.Tensor], strategy: str,
          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(calibrate.ENV, strategy)
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    try:
        ck.save(step, {"m": state})
    finally:
        ck.close()


def test_buffered_par_writes_the_shard_byte_for_byte_as_buffered(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    state = _state(0)
    for strategy in ("buffered", "buffered-par"):
        _save(tmp_path / strategy, 3, state, strategy, monkeypatch)
    one, par = (tmp_path / s / "step_000000003" for s in ("buffered", "buffered-par"))
    assert (par / SHARD).read_bytes() == (one / SHARD).read_bytes()
    assert (par / "COMMITTED").exists()
    events = [json.loads(x) for x in (tmp_path / "buffered-par" / "events.jsonl").read_text().splitlines()]
    assert [e["writer"] for e in events if e["event"] == "save_committed"] == ["buffered-par"]
    loaded = load_file(par / SHARD)  # a stock reader
    assert all(torch.equal(loaded[f"m/{k}"], v) for k, v in state.items())
    info = find_latest(tmp_path / "buffered-par", verify=True)
    assert info is not None and info.step == 3 and info.verified is True


def test_the_sink_writes_with_several_threads_at_their_offsets(tmp_path: Path) -> None:
    """Below the shard: every range lands at its offset whichever thread takes it, the digest is
    the stream's, and the sink really runs PAR_THREADS writers."""
    import xxhash

    parts = [b"h" * 13, bytes(range(256)) * 200_000, b"", b"x" * (writer.CHUNK + 5), b"tail"]
    sink = writer.ShardSink(tmp_path / "f", strategy="buffered-par")
    assert len(sink.threads) == writer.PAR_THREADS >= 2
    for p in parts:
        sink.feed(p)
    digest = sink.finish()
    want = b"".join(parts)
    assert (tmp_path / "f").read_bytes() == want and digest == xxhash.xxh3_64_hexdigest(want)


def test_a_failed_stream_fails_the_save_and_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC on one range (whichever thread took it): the save raises, its step has no marker and
    leaves no temp file, the previous step stays the newest and restores."""
    root = tmp_path / "root"
    first = _state(1)
    _save(root, 1, first, "buffered-par", monkeypatch)
    real = fsio.pwritev_all
    failed: list[int] = []

    def full(fd: int, views: list, offset: int, label: str, path: str = "") -> None:  # noqa: ANN001
        if offset <= writer.CHUNK < offset + sum(len(v) for v in views):  # the range holding byte CHUNK
            failed.append(threading.get_ident())
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, views, offset, label, path)

    monkeypatch.setattr(fsio, "pwritev_all", full)
    with pytest.raises(SaveError, match="nothing committed: no space left"):
        _save(root, 2, _state(2), "buffered-par", monkeypatch)
    assert failed, "the injected failure was never reached"
    assert not (root / "step_000000002" / "COMMITTED").exists()
    assert not list(root.rglob(f".{SHARD}.tmp*"))
    monkeypatch.setattr(fsio, "pwritev_all", real)
    info = find_latest(root, verify=True)
    assert info is not None and info.step == 1
    monkeypatch.setenv(calibrate.ENV, "buffered-par")
    target = {k: torch.zeros_like(v) for k, v in first.items()}
    ck = slurmresume.Checkpointer(root, handle_signals=False)
    try:
        assert ck.restore({"m": target}) == 1
    finally:
        ck.close()
    assert all(torch.equal(target[k], v) for k, v in first.items())


def test_a_belief_calibrated_before_the_path_existed_probes_it_once(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache written before buffered-par (its calibration measured the four older paths): the next
    large save probes buffered-par alone, once, and the bandit knows it from then on; an entry
    with no calibration record is left as it is."""
    import time

    from slurmresume.checkpoint import bandit

    monkeypatch.delenv(calibrate.ENV, raising=False)
    old = {"direct": 1.0, "direct-par": 0.9, "buffered-wb": 0.2, "buffered": 0.8}
    now = time.time()
    belief = {"paths": {n: {"gbps": g, "at": now, "n": 3, "src": bandit.SAVE, "t": 0} for n, g in old.items()},
              "tickets": 1}
    key = calibrate.fs_key(tmp_path)
    calibrate._write_cache(key, bandit.to_entry(belief, now, key=key, calibration={"gbps": old}))
    probed: list[tuple[str, ...]] = []

    def probe(directory: Path, strategies: tuple[str, ...] | None = None, **kw: object) -> dict:
        probed.append(tuple(strategies or ()))
        return {"gbps": {s: 0.5 for s in strategies or ()}, "measured_at": now}

    monkeypatch.setattr(calibrate, "calibrate", probe)
    assert calibrate.choose(tmp_path, size_hint=1 << 30) == ("direct", "calibrated")
    assert calibrate.choose(tmp_path, size_hint=1 << 30)[0] in writer.STRATEGIES
    assert probed == [("buffered-par",)]
    paths = calibrate.cached_choice(tmp_path)["belief"]["paths"]  # type: ignore[index]
    assert paths["buffered-par"]["gbps"] == 0.5 and paths["direct"]["n"] == 3

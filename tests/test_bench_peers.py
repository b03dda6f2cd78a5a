"""scripts/bench.py (issue #51): the DCP peers with 1, 2 and 4 writer threads, the raw writes with
2 streams, every write path of ours and the restore's fresh-memory share, on a state of a few MiB
in this process (the figures are not looked at: the bench runs, and reports what it must)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from slurmresume.checkpoint import calibrate, writer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench.py"


@pytest.mark.slow
def test_the_bench_times_the_dcp_peers_and_ours_on_a_tiny_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    for var in (calibrate.ENV, calibrate.CACHE_ENV):  # the bench sets them: put them back after
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(calibrate.PROBE_ENV, "1")
    calibrate._memo.clear()
    spec = importlib.util.spec_from_file_location("slurmresume_bench", SCRIPT)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "slurmresume_bench", bench)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "KEEP_PAGE_CACHE", True)  # never drop the shared machine's page cache
    r = bench.bench_size(0.01, torch.float32, 1, tmp_path)
    r["ratio_to_best_peer"] = {k: bench.ratio_to_best_peer(r, k) for k in r["all"]
                               if k == bench.OURS or k.startswith("slurmresume save, writer=")}
    timed = set(r["all"])
    assert {"DCP save t1", "DCP save t2", "DCP save t4", "raw O_DIRECT write+fsync, 2 streams",
            "raw buffered write+fdatasync, 2 streams", bench.OURS, bench.FRESH} <= timed, timed
    assert {f"slurmresume save, writer={s}" for s in writer.STRATEGIES} <= timed
    assert r["ratio_to_best_peer"][bench.OURS]["best_peer"] in bench.PEERS
    bench.report([r], None, None)
    out = capsys.readouterr().out
    assert "DCP save t2" in out and "per round:" in out and "of our restore" in out
    assert not list(tmp_path.glob("dcp*")) and not (tmp_path / "ours").exists()  # the bench cleans up

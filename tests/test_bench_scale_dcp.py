"""scripts/bench_scale_dcp.py: torch.distributed.checkpoint's save and load planning measured the
way bench_scale.py measures ours (docs/scaling.md, "DCP beside ours"). Small runs keep the
harness working and its figures sane; the figures themselves come from the script at scale.

Each run is a subprocess: the fake process group and the counting seams stay out of this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, script: str, *args: str) -> list[dict[str, Any]]:
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), *args, "--dir", str(tmp_path),
                           "--json-out", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.name != "scale.json"], "left its checkpoint behind"
    return json.loads(out.read_text())["rows"]


def test_dcp_at_8_and_16_ranks_gives_sane_figures(tmp_path: Path) -> None:
    r8, r16 = _run(tmp_path, "bench_scale_dcp.py", "--models", "tiny", "--ranks", "8,16", "--reshard", "16:12",
                   "--caching")
    for r in (r8, r16):
        assert r["covered"], r  # every tensor's saved chunks tile it
        assert r["items"] == 63 * r["ranks"], r  # tiny: (2 layers x 9 + 3) parameters x 3 (param, 2 moments)
        assert r["coordinator_cpu"]["global plan"] > 0 and r["coordinator_cpu"]["metadata write"] > 0, r
        # the save's last step broadcasts the whole metadata to every rank: a non-zero rank receives it all
        assert r["received"]["other"] > r["broadcast_bytes"] > r["metadata_bytes"] / 2, r
        assert r["save_ops_total"] >= 2 * r["ranks"], r  # a data file per rank: its create and fsync
        same = r["same"]
        assert same["files_read"] == 1 and same["plan_cpu_s"] > 0 and same["plan_peak_bytes"] > 0, same
        cached = r["cached"]  # plan caching: no global planning, fewer bytes to the coordinator
        # the same metadata (its storage_meta names the checkpoint's own path: a few bytes apart)
        assert cached["covered"] and abs(cached["metadata_bytes"] - r["metadata_bytes"]) < 64, cached
        assert cached["received"]["rank0"] < r["received"]["rank0"], (cached, r)
    # .metadata is O(W x T): twice the ranks, about twice the bytes
    assert 1.6 * r8["metadata_bytes"] < r16["metadata_bytes"] < 2.4 * r8["metadata_bytes"], (r8, r16)
    assert r16["reshard"]["to"] == 12 and r16["reshard"]["files_read"] >= 2, r16["reshard"]


def test_bench_scale_runs_dcp_beside_ours(tmp_path: Path) -> None:
    (row,) = _run(tmp_path, "bench_scale.py", "--models", "tiny", "--ranks", "8", "--reshard", "", "--no-memory",
                  "--peer", "dcp")
    assert row["saved"] and row["manifest_bytes"] > 0, row
    assert row["dcp"]["ranks"] == 8 and row["dcp"]["metadata_bytes"] > 0 and "cached" in row["dcp"], row["dcp"]

"""scripts/bench_scale.py: the real save and restore paths at many ranks on one machine (fake
process group, synthetic sparse shards). A smoke run keeps the harness working; a 4,096-rank run
guards today's figures with generous bounds; the issue's 512-rank 7B case waits for format 2.

Each run is a subprocess: the fake process group and the harness's counting seams stay out of
this test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_scale.py"


def _run(tmp_path: Path, *args: str, timeout: float = 600) -> list[dict[str, Any]]:
    out = tmp_path / "scale.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--dir", str(tmp_path), "--json-out", str(out)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("scale-")], "left its checkpoint behind"
    return json.loads(out.read_text())["rows"]


def _check_restore(p: dict[str, Any], bytes_per_rank_at_least: int = 1) -> None:
    assert "error" not in p, p
    assert p["read_bytes"] >= p["needed_bytes"] >= bytes_per_rank_at_least, p


def test_smoke_16_ranks_saves_plans_reads_and_reshards(tmp_path: Path) -> None:
    (row,) = _run(tmp_path, "--models", "tiny", "--ranks", "16", "--reshard", "16:12", "--read", "--no-memory")
    assert row["saved"], row
    assert 0 < row["manifest_bytes"] <= 64 << 20
    assert row["save_ops"]["fsyncdir"] <= 8  # rank 0's, whatever W (#29.6)
    assert row["save_ops"]["fsync"] >= 16  # every shard, its own
    _check_restore(row["same"])
    _check_restore(row["reshard"])
    assert row["reshard"]["to"] == 12


def test_metadata_operations_per_restore_stay_within_4_per_rank(tmp_path: Path) -> None:
    """#29's target, counted at the os and fsio seams at 64 ranks: pick + rank 0's plan + 63 other
    ranks' plans <= 4 W (the old code: 8 W, rank 0 opened every shard and index file to check its
    size and each rank read marker and manifest again). The choice crosses ranks in O(1) bytes."""
    (row,) = _run(tmp_path, "--models", "tiny", "--ranks", "64", "--reshard", "", "--no-memory")
    p = row["same"]
    assert "error" not in p, p
    assert p["restore_ops_total"] <= 4 * 64, p
    assert p["other_plan_ops"] <= 3, p  # the manifest, its own index, its own shard
    assert p["choice_bytes"] < 512, p


@pytest.mark.slow
def test_4096_ranks_within_generous_bounds(tmp_path: Path) -> None:
    """Today's format at 4,096 ranks (a small model: 63 tensors per rank). Bounds are generous
    (a loaded 2-core machine); the issue's targets, for format 2, are tighter: <= 4 W metadata
    operations per restore, < 1 KiB received by a rank that is not the coordinator."""
    (row,) = _run(tmp_path, "--models", "tiny", "--ranks", "4096", "--reshard", "4096:3072", "--read",
                  "--no-memory", timeout=900)
    assert row["saved"], row
    assert row["manifest_bytes"] <= 64 << 20
    assert row["commit_cpu_s"] < 120, row["commit_cpu_s"]
    assert row["save_ops"]["fsyncdir"] <= 8, row["save_ops"]
    for p in (row["same"], row["reshard"]):
        _check_restore(p)
        assert p["pick_cpu_s"] < 120 and p["plan_cpu_s"] < 120, p
        # today: ~37 per rank at the same W, ~79 resharding 4096 -> 3072 (rank 0 opens every shard)
        assert p["restore_ops_total"] <= 160 * p["to"], p


@pytest.mark.slow
def test_a_512_rank_7b_checkpoint_commits_loads_on_512_and_reshards_to_384(tmp_path: Path) -> None:
    (row,) = _run(tmp_path, "--models", "7B", "--ranks", "512", "--reshard", "512:384", "--read", "--no-memory",
                  "--max-manifest-mib", "1024", timeout=1200)
    assert row["saved"], row.get("error")
    _check_restore(row["same"], 100 << 20)  # rank 0's box of a 7B state on 512 ranks: ~160 MB
    _check_restore(row["reshard"], 100 << 20)

"""Scans answer from the commit marker: `latest`, `status` and `prune`'s scan open no manifest and
no shard of a step whose marker carries the scan fields (world size, total bytes, metrics; sealed by
the marker's own checksum), so their cost per step does not grow with the world size (a prune that
deletes reads the manifests of the few steps it keeps, to check their sizes). A marker
whose own checksum fails is corrupt; an older marker without those fields still works, through
its manifest (read for that step only). Sizes are checked where bytes are read: restore, verify.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import xxhash
from helpers.core import record_opens, save_steps, step_dir
from typer.testing import CliRunner

from slurmresume.checkpoint.jsonenc import dumps
from slurmresume.checkpoint.layout import MANIFEST, MARKER
from slurmresume.checkpoint.store import find_latest, list_checkpoints
from slurmresume.cli import app

ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""}
STEPS = list(range(1, 13))


def _cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def _manifest_and_shard_opens(opened: list[tuple[str, int]]) -> list[str]:
    return [p for p, _ in opened if Path(p).name == MANIFEST or p.endswith(".safetensors")]


def test_latest_status_and_prune_read_no_manifest(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_steps(root, STEPS).close()
    with record_opens() as opened:
        r = _cli("latest", "--ckpt-dir", root)
        assert r.exit_code == 0 and r.stdout.strip() == str(step_dir(root, 12)), r.output
        r = _cli("status", "--ckpt-dir", root, "--json")
        assert r.exit_code == 0, r.output
        rows = json.loads(r.stdout)["checkpoints"]
        assert [row["state"] for row in rows] == ["complete"] * len(STEPS)
        assert rows[0]["shards"] == 1 and rows[0]["bytes"] > 0
    assert _manifest_and_shard_opens(opened) == []
    with record_opens() as opened:
        r = _cli("prune", "--keep", 3, "--keep-best", "step", "--mode", "min", "--yes", "--ckpt-dir", root)
        assert r.exit_code == 0, r.output
    # what it deletes counts only after the sizes of what it keeps were checked (retention.plan_checked):
    # their manifests are read (the plan shown, the plan executed), no shard opened
    kept = {str(step_dir(root, s) / MANIFEST) for s in (12, 11, 10, 1)}
    assert set(_manifest_and_shard_opens(opened)) == kept
    # prune kept the newest 3 and the best by the marker's metrics (step 1: the minimum)
    assert [i.step for i in list_checkpoints(root) if i.complete] == [12, 11, 10, 1]


def _old_marker(d: Path) -> None:
    """The marker a release before the scan fields wrote: exactly step and manifest_xxh3."""
    raw = (d / MANIFEST).read_bytes()
    step = json.loads((d / MARKER).read_bytes())["step"]
    (d / MARKER).write_bytes(dumps({"step": step, "manifest_xxh3": xxhash.xxh3_64_hexdigest(raw)}).encode())


def test_an_old_marker_is_read_through_its_manifest_only(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2, 3]).close()
    _old_marker(step_dir(root, 2))
    with record_opens() as opened:
        infos = list_checkpoints(root, scan=True)
    assert [i.complete for i in infos] == [True, True, True]
    assert [i.world_size for i in infos] == [1, 1, 1] and infos[1].metrics == {"step": 2}
    assert _manifest_and_shard_opens(opened) == [str(step_dir(root, 2) / MANIFEST),
                                                 str(step_dir(root, 2) / "rank-00000-of-00001.safetensors")]
    r = _cli("status", "--ckpt-dir", root, "--json")
    assert [row["state"] for row in json.loads(r.stdout)["checkpoints"]] == ["complete"] * 3


def test_a_marker_failing_its_own_checksum_is_corrupt(tmp_path: Path) -> None:
    """One digit of total_bytes changed (still valid JSON, still a plausible size): the marker's
    own checksum catches it. status says corrupt, latest skips to the step before, a restore too."""
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2]).close()
    marker = step_dir(root, 2) / MARKER
    data = json.loads(marker.read_bytes())
    data["total_bytes"] += 1
    marker.write_bytes(json.dumps(data).encode())

    r = _cli("status", "--ckpt-dir", root, "--json")
    rows = {row["step"]: row for row in json.loads(r.stdout)["checkpoints"]}
    assert rows[2]["state"] == "corrupt" and "own checksum" in rows[2]["problem"], rows[2]
    assert rows[1]["state"] == "complete"
    r = _cli("latest", "--ckpt-dir", root)
    assert r.exit_code == 0 and r.stdout.strip() == str(step_dir(root, 1))
    latest = find_latest(root)  # the restore's path (manifest, sizes) says the same
    assert latest is not None and latest.step == 1


def test_a_truncated_shard_is_found_by_restore_and_verify_not_by_the_scan(tmp_path: Path) -> None:
    """The scan trusts the marker (it opens no shard); the restore's and verify's size checks
    still refuse a shard cut short, and the restore falls back to the step before."""
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2]).close()
    shard = step_dir(root, 2) / "rank-00000-of-00001.safetensors"
    os.truncate(shard, shard.stat().st_size - 1)
    assert find_latest(root, scan=True).step == 2  # type: ignore[union-attr]
    assert find_latest(root).step == 1  # type: ignore[union-attr]
    r = _cli("verify", "--all", "--ckpt-dir", root)
    assert r.exit_code != 0 and "step_000000002" in r.output


def test_a_flipped_format_bit_in_a_marker_is_corrupt_everywhere_never_newer(tmp_path: Path) -> None:
    """One bit of the marker's format digit flipped ("slurmresume/3" -> "slurmresume/7"): the
    marker fails its own checksum, so it says nothing, "newer" included: status, latest and
    prune call it corrupt (the restore already did), and prune treats it as it treats any
    corrupt step: not counted, removed only under --remove-incomplete-older-than once idle."""
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2]).close()
    marker = step_dir(root, 2) / MARKER
    raw = bytearray(marker.read_bytes())
    at = raw.index(b'"slurmresume/3"') + len(b'"slurmresume/')
    raw[at] ^= 0x04  # '3' -> '7'
    marker.write_bytes(bytes(raw))

    r = _cli("status", "--ckpt-dir", root, "--json")
    rows = {row["step"]: row for row in json.loads(r.stdout)["checkpoints"]}
    assert rows[2]["state"] == "corrupt" and "own checksum" in rows[2]["problem"], rows[2]
    r = _cli("latest", "--ckpt-dir", root)
    assert r.exit_code == 0 and r.stdout.strip() == str(step_dir(root, 1)), r.output
    r = _cli("prune", "--keep", 1, "--dry-run", "--json", "--ckpt-dir", root)
    assert r.exit_code == 0, r.output
    assert "newer" not in r.stdout and "corrupt" in r.stdout, r.stdout
    old = time.time() - 2 * 86400
    for p in [*step_dir(root, 2).iterdir(), step_dir(root, 2)]:
        os.utime(p, (old, old))
    r = _cli("prune", "--keep", 1, "--remove-incomplete-older-than", "1d", "--yes", "--ckpt-dir", root)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in root.glob("step_*")) == [step_dir(root, 1).name]

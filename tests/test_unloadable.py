"""Never commit what cannot be loaded; never call "corrupt" what this version merely cannot read.

- Save: rank 0 checks the manifest and the marker (and each rank its shard header) against every
  reader cap before the marker; over a cap, the save fails with one line naming ranks and tensors
  and the cap, and nothing is committed (no step directory, no private save directory left).
- Read: a step written by a newer slurmresume (format 4 here, this version reads 3) or over a
  read cap is "unreadable by this version": `latest`/`status`/`verify`/`inspect` say so,
  `restore` refuses (no fall back to an older step that a later save would overwrite it from,
  no fresh start), a save never replaces it, and retention never deletes it.
- The launcher judges "is there something to resume" by the newest marker alone, so such a step
  means requeue (the ranks report what is wrong), never "no checkpoint: give up".
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest
from helpers.core import model_equal, rewrite_manifest, save_steps, step_dir, tiny_model, tiny_state
from helpers.objstore import s3  # noqa: F401 - a fixture
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint import commit, manifest, shard
from slurmresume.checkpoint.collective import Group
from slurmresume.checkpoint.layout import MANIFEST, MARKER, SAVING_PREFIX, step_dir_name
from slurmresume.checkpoint.manifest import over_cap, read_manifest
from slurmresume.checkpoint.rankindex import write_index
from slurmresume.checkpoint.reports import WriteReport
from slurmresume.checkpoint.state import flatten
from slurmresume.checkpoint.store import find_latest, inspect_dir, newest_committed
from slurmresume.cli import app
from slurmresume.contract import Outcome, write_outcome
from slurmresume.errors import SaveError, UnreadableCheckpointError
from slurmresume.job.torchrun import Relay, decide, run_torchrun
from slurmresume.retention import RetentionPolicy, apply_policy, execute
from slurmresume.tools import status as status_mod

NEWER = "written by a newer slurmresume (format 4; this reads 3): upgrade"
ENV = {"COLUMNS": "200", "TERM": "dumb", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""}


def _cli(*args: object):
    return CliRunner().invoke(app, [str(a) for a in args], env=ENV)


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(SAVING_PREFIX))


# -- 1. the save checks every reader cap before the marker ---------------------------------------

@pytest.mark.parametrize(("sizes", "says"), [
    ((100, 50, 3, 7), None),
    ((64 << 20, 4096, 512, 291), None),  # exactly at both caps: readable
    (((64 << 20) + 1, 50, 512, 291), "512 ranks, 291 tensors listed once"),
    ((100, 4097, 3, 7), "marker read cap"),
])
def test_over_cap_is_a_pure_table(sizes: tuple[int, int, int, int], says: str | None) -> None:
    why = over_cap(7, *sizes)
    if says is None:
        assert why is None
    else:
        assert why is not None and says in why and "\n" not in why
        assert str(manifest.MAX_MANIFEST if "manifest" in says or "ranks" in says else manifest.MAX_MARKER) in why


def test_save_over_the_manifest_cap_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three ranks through the real prepare / write_rank / commit protocol, with the manifest read
    cap lowered through its seam below this manifest's size: the save fails with one line naming
    W x T and the cap; step 2 never appears, the older step 1 is untouched."""
    root = tmp_path / "ckpt"
    save_steps(root, [1]).close()
    monkeypatch.setattr(manifest, "MAX_MANIFEST", 200)
    decision = commit.prepare(root, 2)
    assert decision.action == "write"
    reports = []
    for rank in range(3):
        skeleton, tensors = flatten(tiny_state(2), {})
        reports.append(commit.write_rank(root, 2, Group(None, rank, 3), skeleton, tensors, into=decision.dir))
    outcome = commit.commit(root, 2, reports, {"loss": 0.5}, None, into=decision.dir)

    assert outcome.ok is False
    error = outcome.error
    assert "3 ranks," in error and "tensors listed once" in error and "200-byte manifest read cap" in error, error
    assert "\n" not in error
    assert not (root / step_dir_name(2)).exists() and _leftovers(root) == []
    with pytest.raises(SaveError, match="nothing committed: the manifest of step 2"):
        commit.raise_if_failed(outcome)
    monkeypatch.undo()
    assert find_latest(root).step == 1  # type: ignore[union-attr]


def test_a_512_rank_7b_shaped_checkpoint_commits_under_the_real_cap(tmp_path: Path) -> None:
    """The issue's case, at the real 64 MiB cap: 512 ranks x 873 tensors (a 7B model's 291
    parameters and both Adam moments, FSDP2 Shard(0)) made a ~90 MiB format-1 manifest: the
    commit was refused (item 1). Format 2 lists ranks and tensors, not their product: it commits,
    a small manifest, and one rank's entries come from that rank's index file alone."""
    world, digest = 512, "0123456789abcdef"
    names = [f"{kind}/layers.{i // 9}.w{i % 9}" for kind in ("model", "exp_avg", "exp_avg_sq") for i in range(291)]
    root = tmp_path / "ckpt"
    decision = commit.prepare(root, 5)
    d = root / decision.dir

    def report(rank: int) -> WriteReport:
        tensors = {n: {"dtype": "F32", "shape": [8, 4096], "xxh3": [digest], "global_shape": [8 * world, 4096],
                       "global_offset": [8 * rank, 0]} for n in names}
        file = f"rank-{rank:05d}-of-{world:05d}.safetensors"
        (d / file).write_bytes(b"\0" * 4096)
        return WriteReport.from_json({
            "rank": rank, "file": file, "bytes": 4096, "xxh3": digest, "header_xxh3": digest,
            **write_index(d, rank, file, tensors), "pinned": False, "error": None,
            **({"sharded": {n: {"dtype": "F32", "shape": [8 * world, 4096], "placements": ["shard:0"],
                                "mesh_shape": [world]} for n in names}} if rank == 0 else {})})

    outcome = commit.commit(root, 5, [report(r) for r in range(world)], None, None, into=decision.dir)
    assert outcome.ok is True, outcome
    m = read_manifest(root / step_dir_name(5), 5)
    assert (root / step_dir_name(5) / MANIFEST).stat().st_size < 1 << 20 and m.world_size == world
    assert len(m.rank_tensors(511)) == len(names) and list(m._indexes) == [511]
    assert inspect_dir(5, root / step_dir_name(5)).complete


def test_checkpointer_save_over_a_cap_raises_and_keeps_the_previous(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    ckpt = save_steps(root, [1])
    monkeypatch.setattr(manifest, "MAX_MANIFEST", 200)
    with pytest.raises(SaveError, match=r"1 ranks, \d+ tensors listed once.*200-byte manifest read cap"):
        ckpt.save(2, tiny_state(2))
    ckpt.close()
    monkeypatch.undo()
    assert [p.name for p in root.glob("step_*")] == [step_dir_name(1)] and _leftovers(root) == []
    state = tiny_state(987654)
    assert Checkpointer(root, handle_signals=False).restore(state) == 1


def test_shard_header_over_the_read_cap_commits_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    monkeypatch.setattr(shard, "MAX_HEADER", 64)
    ckpt = Checkpointer(root, handle_signals=False)
    with pytest.raises(SaveError, match="header read cap"):
        ckpt.save(1, tiny_state(1))
    ckpt.close()
    assert not (root / step_dir_name(1)).exists() and _leftovers(root) == []


# -- 2. unreadable by this version, never corrupt -------------------------------------------------

def _newer_manifest(d: Path) -> None:
    rewrite_manifest(d, lambda m: m.update(format="slurmresume/4"))


def _newer_marker(d: Path) -> None:
    """A newer release may change what the marker pins: its format says so before anything else."""
    (d / MARKER).write_text(json.dumps({"step": 2, "format": "slurmresume/4", "index_xxh3": "0" * 16}))
    (d / MANIFEST).write_text('{"format": "slurmresume/4", "shards": "elsewhere"}')


@pytest.fixture(params=["manifest", "marker"])
def newer_root(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """Step 1 written by this version, step 2 by a (simulated) newer one; both old enough that an
    age threshold would let retention delete them."""
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2]).close()
    (_newer_manifest if request.param == "manifest" else _newer_marker)(step_dir(root, 2))
    old = time.time() - 30 * 86400
    for d in (step_dir(root, 1), step_dir(root, 2)):
        for p in [*d.iterdir(), d]:
            os.utime(p, (old, old))
    return root


def test_newer_format_is_unreadable_not_corrupt(newer_root: Path) -> None:
    info = inspect_dir(2, step_dir(newer_root, 2))
    assert info.unreadable and not info.complete
    assert NEWER in (info.problem or "")
    with pytest.raises(UnreadableCheckpointError, match=r"format 4; this reads 3\): upgrade"):
        find_latest(newer_root)


@pytest.mark.parametrize("fresh", [False, True])
def test_restore_refuses_a_newer_step_and_never_starts_fresh(newer_root: Path, fresh: bool) -> None:
    state = tiny_state(987654)
    with pytest.raises(UnreadableCheckpointError) as got:
        Checkpointer(newer_root, handle_signals=False).restore(state, allow_fresh_start=fresh)
    assert NEWER in str(got.value) and "\n" not in str(got.value)
    assert model_equal(state["model"], tiny_model(987654)) and state["step"] == 987654  # untouched
    with pytest.raises(UnreadableCheckpointError, match="upgrade"):
        Checkpointer(newer_root, handle_signals=False).restore(tiny_state(0), step=2)


def test_a_save_never_replaces_a_newer_step(newer_root: Path) -> None:
    before = {p.name: p.read_bytes() for p in step_dir(newer_root, 2).iterdir()}
    ckpt = Checkpointer(newer_root, handle_signals=False)
    with pytest.raises(SaveError, match="not replaced: upgrade"):
        ckpt.save(2, tiny_state(2))
    ckpt.close()
    assert {p.name: p.read_bytes() for p in step_dir(newer_root, 2).iterdir()} == before
    assert _leftovers(newer_root) == []


def test_retention_never_deletes_a_step_it_cannot_classify(newer_root: Path) -> None:
    policy = RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0)
    planned = execute(newer_root, policy)
    assert planned.deleted == []
    kept = {d.record.name: d.reasons for d in planned.plan.decisions}
    assert "never deleted" in kept[step_dir_name(2)][0]
    apply_policy(newer_root, policy)  # the library's policy after a commit: the same plan
    assert step_dir(newer_root, 2).is_dir() and step_dir(newer_root, 1).is_dir()


def test_cli_says_newer_everywhere_and_prune_keeps_it(newer_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(status_mod, "run_slurm", lambda args, timeout=10.0: None)
    for args in (["latest"], ["verify"], ["verify", "--all"], ["verify", "2"], ["inspect", "2"]):
        res = _cli(*args, "--ckpt-dir", newer_root)
        assert res.exit_code == 1, (args, res.output)
        lines = res.stderr.splitlines()
        assert len(lines) == 1 and NEWER in lines[0] and "corrupt" not in lines[0], (args, res.stderr)
    res = _cli("status", "--json", "--ckpt-dir", newer_root)
    rows = {r["step"]: r for r in json.loads(res.stdout)["checkpoints"]}
    assert rows[2]["state"] == "unreadable" and NEWER in rows[2]["problem"], rows[2]
    assert rows[1]["state"] == "complete"
    res = _cli("status", "--ckpt-dir", newer_root)
    assert NEWER in " ".join(res.output.split()) and "is corrupt" not in res.output, res.output
    assert res.exit_code == 3, res.output  # at risk: the newest committed step blocks a resume
    res = _cli("prune", "--keep", "1", "--remove-incomplete-older-than", "0s", "--yes", "--ckpt-dir", newer_root)
    assert res.exit_code == 0, res.output
    assert step_dir(newer_root, 2).is_dir()


@pytest.mark.parametrize("where", [MANIFEST, MARKER])
def test_a_flipped_format_digit_is_corrupt_not_newer(tmp_path: Path, where: str) -> None:
    """The format is believed only where a checksum backs it: bit rot that turns "slurmresume/3"
    into "slurmresume/9" (in a manifest its marker no longer pins, or in a marker whose manifest
    says format 3) is corruption, and restore falls back to step 1 as for any corruption."""
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2]).close()
    path = step_dir(root, 2) / where
    raw = path.read_bytes()
    assert raw.count(b'"slurmresume/3"') == 1
    path.write_bytes(raw.replace(b'"slurmresume/3"', b'"slurmresume/9"'))
    info = inspect_dir(2, step_dir(root, 2))
    assert not info.complete and not info.unreadable and info.has_marker, info.problem
    state = tiny_state(987654)
    step = Checkpointer(root, handle_signals=False).restore(state)
    assert step == 1 and model_equal(state["model"], tiny_model(1))


def test_a_committed_step_over_the_read_cap_is_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an older release could commit at scale: the manifest is over this version's cap."""
    root = tmp_path / "ckpt"
    save_steps(root, [1, 2]).close()
    size = (step_dir(root, 2) / MANIFEST).stat().st_size
    monkeypatch.setattr(manifest, "MAX_MANIFEST", size - 1)
    info = inspect_dir(2, step_dir(root, 2))
    assert info.unreadable and "over this version's read cap" in (info.problem or "")
    with pytest.raises(UnreadableCheckpointError, match="over this version's read cap"):
        Checkpointer(root, handle_signals=False).restore(tiny_state(0), allow_fresh_start=True)
    policy = RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0)
    assert execute(root, policy, now=time.time() + 86400).deleted == []
    assert step_dir(root, 2).is_dir()


# -- 3. the launcher asks only for the newest marker ----------------------------------------------

def test_newest_committed_reads_markers_only(newer_root: Path) -> None:
    assert newest_committed(newer_root) == 2
    (newer_root / step_dir_name(3)).mkdir()  # a save killed before its commit: not committed
    (newer_root / step_dir_name(4)).mkdir()
    (newer_root / step_dir_name(4) / MARKER).write_bytes(b"\xff not json")  # unparsable, still committed
    assert newest_committed(newer_root) == 4
    assert newest_committed(newer_root / "absent") is None


def test_launcher_requeues_a_preemption_whose_step_it_cannot_parse(newer_root: Path) -> None:
    """Only the newer step 2 is committed. The old launcher found "no complete checkpoint" and
    gave up; now the run's committed preemption is requeued and the ranks will say what is wrong."""
    shutil.rmtree(step_dir(newer_root, 1))
    run_id = "job.0.0"
    write_outcome(newer_root, Outcome(run_id, "preempt", 2, True))
    relay = Relay(signal.SIGUSR1)
    result = run_torchrun([sys.executable, "-c", "raise SystemExit(0)"], {}, newer_root, run_id,
                          signal.SIGUSR1, relay)
    assert result.latest_after == 2 and result.kind == "preempted"
    action, reason = decide(result, first_node=True, requeues_done=0, max_requeues=5, failures_done=0,
                            max_failures=0, previous_progressed=None)
    assert action == "requeue", reason


# -- the bucket mirror: the same classification, the same retention -------------------------------

def test_bucket_prune_never_deletes_a_newer_step(s3, tmp_path: Path) -> None:  # noqa: F811
    from helpers.objstore import unique_url

    from slurmresume.mirror import parse_s3_url
    from slurmresume.storage import bucketsteps

    url = unique_url()
    ckpt = Checkpointer(tmp_path / "local", handle_signals=False, mirror=url)
    for s in (1, 2):
        ckpt.save(s, tiny_state(s))
        ckpt.mirror.wait()
    ckpt.close()
    loc = parse_s3_url(url)
    d = step_dir(tmp_path / "local", 2)
    _newer_manifest(d)
    for name in (MANIFEST, MARKER):
        s3.put_object(Bucket=loc.bucket, Key=loc.key(2, name), Body=(d / name).read_bytes())

    infos = {i.step: i for i in bucketsteps.list_remote(s3, loc)}
    assert infos[2].unreadable and NEWER in (infos[2].problem or "")
    policy = RetentionPolicy(keep=1, remove_incomplete_older_than=0, young_threshold=0)
    result = bucketsteps.prune(s3, loc, policy, now=time.time() + 86400)
    assert result.deleted == []
    assert s3.list_objects_v2(Bucket=loc.bucket, Prefix=loc.step_prefix(2)).get("KeyCount", 0) >= 3


# -- 4. markers that answer scans ----------------------------------------------------------------

def test_marker_records_what_a_scan_asks_and_stays_small(tmp_path: Path) -> None:
    from slurmresume.checkpoint.manifest import marker_facts, read_manifest

    root = tmp_path / "ckpt"
    ckpt = Checkpointer(root, handle_signals=False)
    ckpt.save(1, tiny_state(1), metrics={"loss": 0.25})
    ckpt.save(2, tiny_state(2), metrics={"notes": "x" * 5000})  # too big for the marker: omitted, still saved
    ckpt.close()
    m1 = read_manifest(step_dir(root, 1), 1)
    raw1 = (step_dir(root, 1) / MARKER).read_bytes()
    facts = marker_facts(json.loads(raw1), step_dir(root, 1) / MARKER)
    assert (facts.step, facts.world_size, facts.total_bytes) == (1, 1, m1.total_bytes)
    assert facts.metrics_known and facts.metrics == m1.metrics == {"loss": 0.25}
    raw2 = (step_dir(root, 2) / MARKER).read_bytes()
    assert len(raw2) <= manifest.MAX_MARKER and json.loads(raw2)["metrics_omitted"] is True
    assert not marker_facts(json.loads(raw2), step_dir(root, 2) / MARKER).metrics_known
    assert inspect_dir(2, step_dir(root, 2)).complete

    # the manifest's checksum does not cover these facts: the marker has its own
    bad = json.loads(raw1)
    bad["world_size"] = 3
    (step_dir(root, 1) / MARKER).write_text(json.dumps(bad, separators=(",", ":")))
    info = inspect_dir(1, step_dir(root, 1))
    assert not info.complete and not info.unreadable and "fails its own checksum" in (info.problem or "")
    # an older release's marker (step and manifest checksum only) still reads
    old = {"step": 1, "manifest_xxh3": bad["manifest_xxh3"]}
    (step_dir(root, 1) / MARKER).write_text(json.dumps(old))
    assert inspect_dir(1, step_dir(root, 1)).complete

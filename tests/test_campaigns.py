"""The reliability campaigns of tests/campaigns/ at CI size, one test each (docs/reliability.md
has the full-size figures). Each runs its campaign in a fresh process (run_in_subprocess, seed 1
or $SLURMRESUME_CAMPAIGN_SEED) and fails on any broken guarantee (assert_clean); the asserts after
it check that the campaign did the work it says (trial counts, counters)."""

from __future__ import annotations

import pkgutil
from pathlib import Path

import campaigns
import pytest
from campaigns.harness import CAMPAIGNS, assert_clean, campaign, run_in_subprocess


def test_every_campaign_has_the_one_shape() -> None:
    """Every module of tests/campaigns/ but the harness is a campaign the harness lists, with
    NAME, DEFAULT_COUNT and run(report, work)."""
    found = {m.name for m in pkgutil.iter_modules(campaigns.__path__)} - {"harness", "__main__", "children"}
    assert found == set(CAMPAIGNS)
    for name in CAMPAIGNS:
        campaign(name)


@pytest.mark.slow
def test_crash_campaign(tmp_path: Path) -> None:
    """Campaign 1 (tests/campaigns/crash.py): a SIGKILL at every file-system step of six
    save/prune scenarios (~145 kills) and of a replace of a committed step, with and without
    RENAME_EXCHANGE (~22), plus 60 seeded random SIGKILLs of a training process while it saves
    (some replacing each step). After each: no partial restore, no committed checkpoint lost, no
    wrong resume, no second copy stranded, the next save works."""
    report = run_in_subprocess("crash", 60, tmp_path)
    assert_clean(report)
    stats = report["stats"]
    assert report["trials"] >= 200
    assert stats["boundary_kills"] >= 160 and set(stats["labels"]) == {
        "save", "save-over-stale", "save+retention", "prune", "world2", "async", "replace", "replace-nox"}
    assert stats["partial_loads"] == 0 and stats["lost_committed"] == 0
    assert stats["wrong_resumes"] == 0 and stats["stranded_copies"] == 0
    assert stats["replace-nox_kills"] >= 6  # each point of the two-rename replace
    assert stats.get("replace-nox_resumed_old_copy", 0) > 0 and stats.get("replace-nox_resumed_new_copy", 0) > 0
    assert stats.get("variant_final-nox", 0) > 0  # random kills of a run that replaces each step too
    assert stats.get("random_kills", 0) >= 40  # the rest end in an emergency exit first
    assert stats.get("kill_left_partial_dir", 0) > 0  # random kills do land inside saves


@pytest.mark.slow
def test_disk_full_campaign(tmp_path: Path) -> None:
    """Campaign 2 (tests/campaigns/diskfull.py): ENOSPC in every phase of a save on a small tmpfs
    (bytes and inodes swept page by page, O_DIRECT and buffered; ENOSPC at fsync simulated).
    Needs root for `mount -t tmpfs`; skipped otherwise, saying why."""
    report = run_in_subprocess("diskfull", 1, tmp_path)
    if report["skipped"]:
        pytest.skip(report["skipped"])
    assert_clean(report)
    phases = " | ".join(report["stats"]["phases"])
    for phase in (".inprogress (write", "shard (write", "shard (fsync", "manifest.json (write",
                  "manifest.json (fsync", "COMMITTED (write", "COMMITTED (fsync", "shard (create",
                  "step dir (mkdir"):
        assert phase in phases, (phase, phases)
    assert report["trials"] >= 50


@pytest.mark.slow
def test_io_error_campaign(tmp_path: Path) -> None:
    """Campaign 3 (tests/campaigns/ioerror.py): an injected EIO at every file-system step of the
    six save/prune scenarios, in raise and warn mode: SaveError, no marker, nothing left behind,
    previous checkpoint intact, the next save works."""
    report = run_in_subprocess("ioerror", 1, tmp_path)
    assert_clean(report)
    assert report["trials"] >= 200
    assert report["stats"]["save_error"] >= 80 and report["stats"]["prune_error"] >= 4
    assert report["stats"]["partial_loads"] == 0


@pytest.mark.slow
def test_corruption_campaign(tmp_path: Path) -> None:
    """Campaign 4 (tests/campaigns/corrupt.py): 200 seeded damages after commit (bit flips, zeroed
    ranges, truncation, deletion, hand edits): restore(verify=True) never returns damaged data,
    falls back naming the file; `verify --all` (also the real CLI) flags it."""
    report = run_in_subprocess("corrupt", 200, tmp_path)
    assert_clean(report)
    assert report["trials"] == 200
    assert report["stats"]["partial_loads_verify"] == 0
    assert report["stats"]["detected"] >= 180 and report["stats"]["cli_verify_runs"] >= 8


@pytest.mark.slow
def test_hostile_checkpoint_campaign(tmp_path: Path) -> None:
    """Campaign 5 (tests/campaigns/hostile.py): the hostile corpus of tests/hostile/corpus.py in
    full, plus 30 seeded structural fuzz trials: refused with a clear error, nothing outside the
    step directory opened, nothing unpickled or executed, memory bounded, nothing hangs."""
    from hostile.corpus import CASES

    report = run_in_subprocess("hostile", 30, tmp_path)
    assert_clean(report)
    assert report["stats"]["corpus_cases"] == len(CASES)
    growth = report["stats"]["max_rss_growth_mib"]
    assert growth["header-claims-2^62"] < 64 and growth["header-huge-shape"] < 64


@pytest.mark.slow
def test_hostile_arguments_campaign(tmp_path: Path) -> None:
    """Campaign 6 (tests/campaigns/args.py): every ASCII control character in every `submit`
    option, the --sbatch key and value, the script path and arguments, --resume-from, --branch and
    slurmresume.toml defaults (plus 100 seeded fuzz trials): refused, nothing written, the fake
    sbatch never called; script arguments reach torchrun verbatim as list elements."""
    report = run_in_subprocess("args", 100, tmp_path)
    assert_clean(report)
    assert report["stats"]["matrix_trials"] >= 18 * 33
    assert report["trials"] >= report["stats"]["matrix_trials"] + 100


@pytest.mark.slow
def test_concurrency_campaign(tmp_path: Path) -> None:
    """Campaign 7 (tests/campaigns/concurrency.py): one ~6 s round of a writer, two prunes
    (library and CLI) and a status reader at once while the lock file is swapped for a symlink."""
    report = run_in_subprocess("concurrency", 1, tmp_path)
    assert_clean(report)
    s = report["stats"]
    assert s["saves_committed"] >= 10 and s["prunes_done"] >= 10 and s["lock_swaps"] >= 3
    assert s["status_snapshots"] >= 10 and s.get("dirs_deleted", 0) > 0


@pytest.mark.slow
def test_readers_campaign(tmp_path: Path) -> None:
    """Campaign 8 (tests/campaigns/readers.py): three readers list the root while a writer saves;
    every "complete" checkpoint they see has all its files whole. A negative control (a writer
    that puts the marker first) must be caught."""
    report = run_in_subprocess("readers", 1, tmp_path)
    assert_clean(report)
    assert report["stats"]["control_broken_writer_caught"] > 0
    assert report["stats"]["complete_observations"] >= 100
    assert report["stats"]["partial_checkpoints_seen_complete"] == 0


@pytest.mark.slow
def test_permissions_campaign(tmp_path: Path) -> None:
    """Campaign 9 (tests/campaigns/perms.py): under umask 022 and 077 (and 027/002/000) nothing
    that slurmresume creates (root and parents, step files, events.jsonl, the lock) has
    group/world write bits or more than the umask allows."""
    report = run_in_subprocess("perms", 1, tmp_path)
    assert_clean(report)
    modes = report["stats"]["modes"]
    strict = modes["077"]
    for rel in ("a", "a/b/root", "a/b/root/events.jsonl", "a/b/root/.slurmresume.lock",
                "a/b/root/step_000000002/COMMITTED", "a/b/root/step_000000002/rank-00000-of-00001.safetensors"):
        assert int(strict[rel], 8) & 0o077 == 0, (rel, strict[rel])
    for rel, mode in modes["022"].items():
        assert int(mode, 8) & 0o022 == 0, (rel, mode)

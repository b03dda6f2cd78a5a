"""Damage after commit, and hostile checkpoints.

Corruption: flipped bytes are caught by checksums (restore with verify=True, inspect_dir
verify=True); truncation and a missing shard are caught by the size check that always runs;
a hand-edited manifest is refused because the marker pins its hash.

Manifest safety: manifests crafted with a valid marker (re-written with marker_bytes) that
name files outside the step directory, a shard replaced by a symlink or a FIFO, duplicate keys, a safetensors header claiming a huge size. Each is refused with
CorruptCheckpointError / UnsafeCheckpointError, restore falls back (or starts fresh), and no
file outside the step directory is opened. A manifest over the read cap is not corrupt but
unreadable by this version: restore refuses it (UnreadableCheckpointError)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.core import (
    deadline,
    effective_targets,
    model_equal,
    record_opens,
    restore_fresh,
    rewrite_manifest,
    rewrite_manifest_raw,
    save_steps,
    shard,
    step_dir,
    tiny_model,
    tiny_state,
)

from slurmresume import Checkpointer, CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from slurmresume.checkpoint.layout import MANIFEST, MARKER
from slurmresume.checkpoint.manifest import MAX_MANIFEST, read_manifest
from slurmresume.checkpoint.shardread import load_tensors, read_header
from slurmresume.checkpoint.store import inspect_dir
from slurmresume.errors import UnreadableCheckpointError


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "root"
    save_steps(root, [1, 2])
    return root


@pytest.fixture
def root(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of a root holding committed steps 1 and 2, plus tmp/outside/ for decoys."""
    dst = tmp_path / "root"
    shutil.copytree(pristine, dst, symlinks=True)
    (tmp_path / "outside").mkdir()
    return dst


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _flip(path: Path, offset_from_end: int = 5, count: int = 3) -> None:
    data = bytearray(path.read_bytes())
    for i in range(count):
        data[-offset_from_end - i] ^= 0xFF
    path.write_bytes(bytes(data))


# -- corruption after commit ------------------------------------------------------------------

def test_flipped_bytes_fall_back_with_verify_and_warning_names_the_shard(
    root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = shard(root, 2)
    size = bad.stat().st_size
    _flip(bad)  # in the tensor data, at the end of the file: still parses, same size
    assert bad.stat().st_size == size

    info = inspect_dir(2, step_dir(root, 2), verify=True)
    assert not info.complete and info.verified is False
    assert str(bad) in info.problem and "checksum" in info.problem
    assert inspect_dir(2, step_dir(root, 2)).complete  # sizes alone cannot see a flipped bit
    assert inspect_dir(1, step_dir(root, 1), verify=True).verified is True

    caplog.set_level(logging.WARNING, logger="slurmresume")
    step, state = restore_fresh(root, verify=True)
    assert step == 1 and model_equal(state["model"], tiny_model(1))
    assert any(str(bad) in m for m in _warnings(caplog)), _warnings(caplog)

    with pytest.raises(CorruptCheckpointError, match="checksum"):  # asking for exactly step 2
        Checkpointer(root, handle_signals=False).restore(tiny_state(0), step=2, verify=True)


def test_flipped_header_byte_without_verify_falls_back(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A flip that breaks the shard's header is noticed while loading even without verify;
    the fallback then verifies the previous step."""
    bad = shard(root, 2)
    data = bytearray(bad.read_bytes())
    data[8] = ord("[")  # the header JSON must be an object
    bad.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="slurmresume")
    step, _ = restore_fresh(root)
    assert step == 1
    assert any("step 2" in m and str(bad) in m for m in _warnings(caplog)), _warnings(caplog)


@pytest.mark.parametrize("damage", ["truncate", "extend", "delete", "empty"])
def test_size_damage_caught_without_verify(root: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    bad = shard(root, 2)
    if damage == "truncate":
        os.truncate(bad, bad.stat().st_size - 100)
    elif damage == "extend":
        with open(bad, "ab") as f:
            f.write(b"\0" * 8)
    elif damage == "empty":
        os.truncate(bad, 0)
    else:
        bad.unlink()
    info = inspect_dir(2, step_dir(root, 2), verify=False)
    assert not info.complete and str(bad) in info.problem
    assert ("missing" if damage == "delete" else "bytes") in info.problem
    caplog.set_level(logging.WARNING, logger="slurmresume")
    step, state = restore_fresh(root, verify=False)
    assert step == 1 and model_equal(state["model"], tiny_model(1))
    assert any(str(bad) in m for m in _warnings(caplog)), _warnings(caplog)


def test_hand_edited_manifest_is_refused(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = step_dir(root, 2)
    m = json.loads((d / MANIFEST).read_bytes())
    m["metrics"] = {"step": 2, "loss": 0.001}  # a "nicer" number, marker left alone
    (d / MANIFEST).write_text(json.dumps(m, separators=(",", ":")))
    with pytest.raises(CorruptCheckpointError, match="commit marker"):
        read_manifest(d, 2)
    info = inspect_dir(2, d)
    assert not info.complete and "edited" in info.problem
    caplog.set_level(logging.WARNING, logger="slurmresume")
    assert restore_fresh(root)[0] == 1
    assert any(str(d) in m for m in _warnings(caplog))


def test_missing_or_garbage_marker(root: Path) -> None:
    (step_dir(root, 2) / MARKER).write_bytes(b"\xff\xfe not json")
    assert "commit marker" in inspect_dir(2, step_dir(root, 2)).problem
    (step_dir(root, 1) / MARKER).unlink()
    assert not inspect_dir(1, step_dir(root, 1)).complete
    # nothing usable, but step 2 was committed once: no silent fresh start (issue #13, item 6)
    with pytest.raises(CheckpointError, match="refusing a fresh start.*allow_fresh_start=True"):
        restore_fresh(root)
    assert restore_fresh(root, allow_fresh_start=True)[0] == 0  # asked for: fresh start


def test_corrupt_committed_step_is_rewritten_by_a_later_save(root: Path) -> None:
    """After falling back from a damaged step 2, reaching step 2 again must not be a no-op
    ("already committed") that keeps the damaged files."""
    os.truncate(shard(root, 2), 100)
    ckpt = Checkpointer(root, handle_signals=False)
    assert ckpt.restore(tiny_state(0)) == 1
    assert ckpt.save(2, tiny_state(2)) == step_dir(root, 2)
    assert inspect_dir(2, step_dir(root, 2), verify=True).verified
    assert restore_fresh(root)[0] == 2
    # an intact committed step holding this very state is skipped (idempotent final saves); the
    # RNG states are state too: building tiny_state drew from torch's, so save once more first
    state = tiny_state(2)
    ckpt.save(2, state)
    assert ckpt.save(2, state) is None


# -- hostile manifests --------------------------------------------------------------------------

def _set_shard_name(name: Callable[[Path], str]) -> Callable[[Path], None]:
    def craft(root: Path) -> None:
        d = step_dir(root, 2)
        outside = root.parent / "outside"
        decoy = outside / "rank-00000-of-00001.safetensors"
        shutil.copy(shard(root, 2), decoy)  # a perfectly valid shard, just not ours
        target = name(root)

        def edit(m: dict) -> None:
            m["shards"][0]["file"] = target
        rewrite_manifest(d, edit)
    return craft


def _symlinked_shard(root: Path) -> None:
    decoy = root.parent / "outside" / "rank-00000-of-00001.safetensors"
    shutil.copy(shard(root, 2), decoy)
    shard(root, 2).unlink()
    shard(root, 2).symlink_to(decoy)  # same size, same checksum: only the link gives it away


def _symlinked_manifest(root: Path) -> None:
    d = step_dir(root, 2)
    decoy = root.parent / "outside" / MANIFEST
    shutil.copy(d / MANIFEST, decoy)
    (d / MANIFEST).unlink()
    (d / MANIFEST).symlink_to(decoy)


def _fifo(name: str) -> Callable[[Path], None]:
    def craft(root: Path) -> None:
        p = step_dir(root, 2) / name
        p.unlink()
        os.mkfifo(p)
    return craft


def _oversized_manifest(root: Path) -> None:
    d = step_dir(root, 2)
    with open(d / MANIFEST, "r+b") as f:  # sparse: the size check must come before any read
        f.truncate(MAX_MANIFEST + 1)


def _duplicate_keys(root: Path) -> None:
    d = step_dir(root, 2)
    raw = (d / MANIFEST).read_bytes()
    assert raw.startswith(b"{")
    # a second "shards" key: a parser keeping the last one would see another file list
    rewrite_manifest_raw(d, b'{"shards":[],' + raw[1:])


def _header_claims(n: int) -> Callable[[Path], None]:
    def craft(root: Path) -> None:
        p = shard(root, 2)
        data = bytearray(p.read_bytes())
        data[:8] = struct.pack("<Q", n)
        p.write_bytes(bytes(data))
        import xxhash

        digest = xxhash.xxh3_64_hexdigest(bytes(data))

        def edit(m: dict) -> None:  # consistent checksum: only the header bound can refuse it
            m["shards"][0]["xxh3"] = digest
        rewrite_manifest(step_dir(root, 2), edit)
    return craft


def _offsets_outside(root: Path) -> None:
    p = shard(root, 2)
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    header[name]["data_offsets"] = [begin, end + 10**9]
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    new = struct.pack("<Q", len(raw)) + raw + data[8 + n:]
    p.write_bytes(new)
    import xxhash

    def edit(m: dict) -> None:  # sizes and checksum consistent: only the offsets are wrong
        m["shards"][0]["xxh3"] = xxhash.xxh3_64_hexdigest(new)
        m["shards"][0]["bytes"] = len(new)
    rewrite_manifest(step_dir(root, 2), edit)


def _bad_skeleton(root: Path) -> None:
    """A shard whose JSON skeleton (safetensors metadata) is structurally wrong."""
    import xxhash
    from safetensors.torch import load_file, save_file

    p = shard(root, 2)
    save_file(load_file(str(p)), str(p), metadata={"slurmresume.skeleton": '{"entries":[1,2]}',
                                                   "format": "pt"})
    data = p.read_bytes()

    def edit(m: dict) -> None:
        m["shards"][0]["xxh3"] = xxhash.xxh3_64_hexdigest(data)
        m["shards"][0]["bytes"] = len(data)
    rewrite_manifest(step_dir(root, 2), edit)


HOSTILE = {
    "dotdot-name": (_set_shard_name(lambda r: "../../outside/rank-00000-of-00001.safetensors"),
                    UnsafeCheckpointError, "plain shard file name"),
    "slash-name": (_set_shard_name(lambda r: "sub/rank-00000-of-00001.safetensors"),
                   UnsafeCheckpointError, "plain shard file name"),
    "absolute-name": (_set_shard_name(lambda r: str(r.parent / "outside" / "rank-00000-of-00001.safetensors")),
                      UnsafeCheckpointError, "plain shard file name"),
    "dotdot-only": (_set_shard_name(lambda r: ".."), UnsafeCheckpointError, "plain shard file name"),
    "symlinked-shard": (_symlinked_shard, UnsafeCheckpointError, "refusing shard"),
    "symlinked-manifest": (_symlinked_manifest, UnsafeCheckpointError, "refusing manifest"),
    "fifo-shard": (_fifo("rank-00000-of-00001.safetensors"), UnsafeCheckpointError, "not a regular file"),
    "fifo-manifest": (_fifo(MANIFEST), UnsafeCheckpointError, "not a regular file"),
    "fifo-marker": (_fifo(MARKER), UnsafeCheckpointError, "not a regular file"),
    "duplicate-keys": (_duplicate_keys, UnsafeCheckpointError, "duplicate key 'shards'"),
    "huge-header": (_header_claims(1 << 62), UnsafeCheckpointError, "-byte header"),
    "header-past-eof": (_header_claims(10**6), UnsafeCheckpointError, "-byte header"),
    "offsets-outside": (_offsets_outside, UnsafeCheckpointError, "offsets outside"),
    "bad-skeleton": (_bad_skeleton, CorruptCheckpointError, "skeleton"),
}


def _refusal(root: Path) -> Exception | None:
    """Run every read the loader does on step 2; return the first refusal."""
    d = step_dir(root, 2)
    try:
        m = read_manifest(d, 2)
        s = m.shards[0]
        read_header(d, s["file"], s["bytes"])
        tensors, meta, _ = load_tensors(d, s["file"], s["bytes"])
        from slurmresume.checkpoint.jsonenc import loads
        from slurmresume.checkpoint.state import unflatten_into

        unflatten_into({"model": tiny_model(0)}, loads(meta["slurmresume.skeleton"], "skeleton"), tensors,
                       strict=False)
    except CorruptCheckpointError as exc:
        return exc
    return None


# Refused while loading (the manifest and sizes are consistent): inspect_dir need not see them.
LOAD_TIME = {"huge-header", "header-past-eof", "offsets-outside", "bad-skeleton"}


@pytest.mark.parametrize("case", list(HOSTILE))
@pytest.mark.parametrize("previous", [True, False], ids=["fallback", "fresh"])
def test_hostile_checkpoint_is_refused(root: Path, case: str, previous: bool,
                                       caplog: pytest.LogCaptureFixture) -> None:
    craft, error, message = HOSTILE[case]
    if not previous:
        shutil.rmtree(step_dir(root, 1))
    craft(root)
    outside = (root.parent / "outside").resolve()
    caplog.set_level(logging.WARNING, logger="slurmresume")

    with deadline(10), record_opens() as opened:
        exc = _refusal(root)
        info = inspect_dir(2, step_dir(root, 2), verify=True)
        step, state = restore_fresh(root, allow_fresh_start=not previous)

    if not previous:  # a committed (hostile) step 2 and nothing loads: no silent fresh start
        with pytest.raises(CheckpointError, match="refusing a fresh start"):
            restore_fresh(root)
    assert isinstance(exc, error), (case, exc)
    assert message in str(exc), str(exc)
    assert "\n" not in str(exc)
    if case not in LOAD_TIME:
        assert not info.complete and info.problem
    assert step == (1 if previous else 0)
    # falls back to step 1, or starts fresh with the state as it was before restore()
    assert model_equal(state["model"], tiny_model(1 if previous else 987654))
    assert state["step"] == (1 if previous else 987654)
    named = [m for m in _warnings(caplog) if str(step_dir(root, 2)) in m or "step 2 " in m]
    assert named, _warnings(caplog)
    for target in effective_targets(opened):
        assert not target.is_relative_to(outside), f"{case}: opened {target} outside the step directory"


@pytest.mark.parametrize("previous", [True, False], ids=["older-step", "alone"])
def test_oversized_manifest_is_unreadable_not_corrupt(root: Path, previous: bool) -> None:
    """A manifest over this version's read cap may be a valid step (a bigger run, a newer release):
    refused as unreadable by this version, before any byte of it is read; restore neither falls
    back to step 1 (a later save of step 2 would overwrite it) nor starts fresh."""
    if not previous:
        shutil.rmtree(step_dir(root, 1))
    _oversized_manifest(root)
    outside = (root.parent / "outside").resolve()
    with deadline(10), record_opens() as opened:
        with pytest.raises(UnreadableCheckpointError, match="over this version's read cap") as got:
            read_manifest(step_dir(root, 2), 2)
        info = inspect_dir(2, step_dir(root, 2), verify=True)
        for fresh in (False, True):
            with pytest.raises(UnreadableCheckpointError, match="over this version's read cap"):
                restore_fresh(root, allow_fresh_start=fresh)
    assert "\n" not in str(got.value)
    assert info.unreadable and not info.complete
    for target in effective_targets(opened):
        assert not target.is_relative_to(outside), f"opened {target} outside the step directory"


def test_validate_skeleton() -> None:
    from slurmresume import ConfigError
    from slurmresume.checkpoint.state import validate_skeleton

    good = {"entries": {"model": {"kind": "stateful", "value": {"w": {"__tensor__": "model/w"}}},
                        "step": {"kind": "value", "value": 3}}, "library": {}}
    validate_skeleton(["model", "step"], good, {"model/w"})
    validate_skeleton(["model", "extra"], good, {"model/w"}, strict=False)
    with pytest.raises(ConfigError, match=r"\['extra'\].*strict=False"):
        validate_skeleton(["model", "extra"], good, {"model/w"})
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        validate_skeleton(["model"], good, {"model/v"})
    for bad in ([], {"entries": []}, {"entries": {"m": 1}}, {"entries": {"m": {"kind": "x", "value": 1}}},
                {"entries": {"m": {"kind": "value"}}}):
        with pytest.raises(CorruptCheckpointError, match="skeleton"):
            validate_skeleton([], bad, None)


def test_damaged_rng_state_falls_back_without_verify(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Zeroed torch RNG bytes (sizes intact, no separate checksum pass) are refused while nothing
    has been restored yet: the default restore falls back to step 1 instead of raising half-way.
    The per-block digests catch it as it is read."""
    path = shard(root, 2)
    header, start = read_header(step_dir(root, 2), path.name, path.stat().st_size)
    name = next(n for n in header if n.endswith("torch_cpu"))
    begin, end = header[name]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(start + begin)
        f.write(b"\0" * (end - begin))
    with caplog.at_level(logging.WARNING, logger="slurmresume"):
        step, state = restore_fresh(root)
    assert step == 1 and model_equal(state["model"], tiny_model(1))
    assert any("torch_cpu' fails its checksum" in r.getMessage() for r in caplog.records)


def test_a_model_that_does_not_fit_is_refused_before_anything_loads(root: Path) -> None:
    """Another architecture: a ConfigError naming the tensor and both shapes, raised before the
    first byte is read, so neither the model nor any other entry is touched (no fallback either:
    every older checkpoint would be refused the same way)."""
    import torch
    from torch import nn

    from slurmresume import ConfigError
    wide = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    state = {"model": wide, "step": -1, "extra": None}
    with pytest.raises(ConfigError, match=r"0\.weight has shape \[16, 4\] here, \[8, 4\] in the checkpoint"):
        Checkpointer(root, handle_signals=False).restore(state)
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())
    assert state["step"] == -1 and state["extra"] is None
    fewer = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    with pytest.raises(ConfigError, match="keys missing from the checkpoint"):
        Checkpointer(root, handle_signals=False).restore({"model": fewer, "step": 0, "extra": None})

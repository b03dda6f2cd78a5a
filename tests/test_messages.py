"""What ranks tell each other (train/messages.py, checkpoint/reports.py) survives the JSON trip of
a collective unchanged, and an error crosses ranks as (kind, message) and comes out as the same
exception class. The save sequence's records are what `checkpoint.commit` really returns and reads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from slurmresume.checkpoint import commit as _commit
from slurmresume.checkpoint.collective import Group
from slurmresume.checkpoint.reports import PrepareDecision, SaveOutcome, WriteReport
from slurmresume.checkpoint.store import find_latest
from slurmresume.errors import (
    CheckpointError,
    ConfigError,
    CorruptCheckpointError,
    NoCheckpointError,
    NotPermittedError,
    SaveError,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
)
from slurmresume.train.messages import Failure, RestoreChoice, pick_from_json, pick_to_json
from slurmresume.train.saving import Payload, save_collective


def _wire(d: Any) -> Any:
    """What a real all_gather_json does to a value: JSON out and back."""
    return json.loads(json.dumps(d, separators=(",", ":")))


MESSAGES = [
    Failure("corrupt", "shard rank-00000-of-00001 fails its checksum"),
    PrepareDecision("write", ".saving.step_000000003.abcdef0123456789", True),
    PrepareDecision("skip"),
    PrepareDecision("error", error="no space left on device"),
    WriteReport(0, "rank-00000-of-00002.safetensors", 1234, "ab" * 8, "cd" * 8, "rank-00000.index.json", 321,
                "ef" * 8, True, sharded={"model.w": {"dtype": "F32", "shape": [4, 2], "placements": ["shard:0"]}},
                replicated=("model.b",)),
    WriteReport(1, "rank-00001-of-00002.safetensors", 1234, "ab" * 8, "cd" * 8, "rank-00001.index.json", 321,
                "ef" * 8),
    WriteReport(1, "rank-00001-of-00002.safetensors", error="permission denied writing /x"),
    SaveOutcome(True, "/ckpt/step_000000003"),
    SaveOutcome(False, error="disk quota exceeded"),
    RestoreChoice(7, "/ckpt/step_000000007", 2, "0123456789abcdef", {"model.w": {"dtype": "F32"}}, True),
]


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_json(message: Any) -> None:
    assert type(message).from_json(_wire(message.to_json())) == message


@pytest.mark.parametrize("pick", [None, MESSAGES[0], MESSAGES[-1]], ids=["none", "failure", "choice"])
def test_rank_zeros_restore_pick_round_trips(pick: Any) -> None:
    assert pick_from_json(_wire(pick_to_json(pick))) == pick


@pytest.mark.parametrize(("exc", "kind", "raised"), [
    (UnsafeCheckpointError("x"), "unsafe", UnsafeCheckpointError),
    (CorruptCheckpointError("x"), "corrupt", CorruptCheckpointError),
    (ConfigError("x"), "config", ConfigError),
    (CheckpointError("x"), "checkpoint", CheckpointError),
    (SaveError("x"), "checkpoint", CheckpointError),
    (NoCheckpointError("x"), "checkpoint", CheckpointError),
    (OSError(5, "Input/output error"), "checkpoint", CheckpointError),
])
def test_an_error_crosses_ranks_as_kind_and_message(exc: BaseException, kind: str, raised: type) -> None:
    failure = Failure.from_json(_wire(Failure.of(exc).to_json()))
    assert failure.kind == kind and failure.message == str(exc)
    err = failure.error()
    assert type(err) is raised and str(err) == str(exc)


@pytest.mark.parametrize("exc", [
    NotPermittedError("shard /r/step_000000002/rank-00000-of-00001.safetensors is unreadable by this user", "/r"),
    PermissionError(13, "Permission denied", "/r/step_000000002/rank-00000-of-00001.safetensors"),
], ids=["ours", "raw"])
def test_a_permission_error_on_any_rank_ends_the_restore_as_unreadable(exc: BaseException) -> None:
    """Another user's file is never a reason to fall back to an older step (a later save would
    overwrite the step from there): decisive, raised on every rank, naming the step."""
    failure = Failure.on_rank(exc, 3, 4, "reading its part of step 2")
    assert failure.kind == "unreadable" and failure.decisive, failure
    assert "step_000000002" in failure.message and "unreadable by this user" in failure.message, failure
    assert type(Failure.from_json(_wire(failure.to_json())).error()) is UnreadableCheckpointError


def test_an_unknown_kind_from_a_peer_is_a_checkpoint_error() -> None:
    assert type(Failure("from-a-newer-version", "m").error()) is CheckpointError


def test_the_commit_protocol_returns_typed_records_that_survive_the_wire(tmp_path: Path) -> None:
    """prepare / write_rank / commit return the records themselves (no dict to decode in train/),
    and each comes back unchanged from the JSON it is turned into at a collective or a file."""
    decision = _commit.prepare(tmp_path, 5)
    assert isinstance(decision, PrepareDecision) and decision.action == "write", decision
    assert PrepareDecision.from_json(_wire(decision.to_json())) == decision
    report = _commit.write_rank(tmp_path, 5, Group(), {"w": {"__tensor__": "w"}}, [("w", torch.arange(4.0))],
                                into=decision.dir)
    assert isinstance(report, WriteReport) and report.error is None and report.bytes > 0, report
    assert WriteReport.from_json(_wire(report.to_json())) == report  # a file between failure-save writers
    assert WriteReport.from_json(_wire(report.record())) == dataclasses.replace(report, sharded={}, replicated=())
    outcome = _commit.commit(tmp_path, 5, [report], None, None, into=decision.dir)
    assert outcome == SaveOutcome(True, str(tmp_path / "step_000000005"))


def test_a_record_that_crosses_ranks_is_fixed_size() -> None:
    """What a rank sends rank 0 after its write has no per-tensor part (rank 0 keeps its own)."""
    full = MESSAGES[4]
    assert isinstance(full, WriteReport)
    assert "sharded" not in full.record() and "replicated" not in full.record() and len(json.dumps(full.record())) < 400


def test_save_collective_on_a_world_of_one_commits_then_skips(tmp_path: Path) -> None:
    payload = Payload({"w": {"__tensor__": "w"}}, [("w", torch.arange(4.0))])
    first = save_collective(Group(), tmp_path, 3, payload, replace_if_changed=False)
    assert not first.skipped and first.outcome == SaveOutcome(True, str(tmp_path / "step_000000003"))
    assert first.bytes > 0 and find_latest(tmp_path).step == 3
    again = save_collective(Group(), tmp_path, 3, payload, replace_if_changed=False)
    assert again.skipped and again.outcome is None

"""Issue #45, point 3: a kill while a final save replaces an already-committed step, on a file
system without renameat2(RENAME_EXCHANGE) (NFS, Lustre, GPFS: forced here with
SLURMRESUME_TEST_NO_RENAME_EXCHANGE=1). There the replace takes two renames; a kill between them
once left no step_N, the next run resumed an older step and its first retention pass deleted
the old copy from `.deleting.*`, while the new copy stayed in a note-less `.saving.*` forever.

The table is every seam label a replace crosses once its new copy is committed (from the trace
of a real one), each a SIGKILL of a forked child. After each, the next run (a Checkpointer with
retention that restores, saves the next step and prunes) resumes step 2 with exactly the old or
the new copy's bytes, keeps it, and leaves no second copy of it behind."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
from campaigns.harness import fork_call, seam_spec, trace_of
from helpers.core import model_equal, save_steps, tiny_model, tiny_state

from slurmresume import Checkpointer
from slurmresume.checkpoint import leftovers
from slurmresume.checkpoint.layout import MARKER, REPLACED_PREFIX, SAVING_PREFIX, step_dir_name
from slurmresume.checkpoint.store import inspect_dir
from slurmresume.contract import ENV_LEASE_HEARTBEAT
from slurmresume.retention import RetentionPolicy

NO_EXCHANGE = "SLURMRESUME_TEST_NO_RENAME_EXCHANGE"  # read by fsio when a forked child arms the seam


def _new_state() -> dict[str, Any]:
    """What the final save of step 2 holds: other weights, other plain values (a final evaluation)."""
    return {"model": tiny_model(77), "step": 2, "extra": {"tag": "final", "ints": (1, 2, 2)}}


def _replace(root: Path) -> None:
    ck = Checkpointer(root, handle_signals=False)
    assert ck.save(2, _new_state()) == root / step_dir_name(2)  # a replace: step 2 is committed already
    ck.close()


def _which(state: dict[str, Any]) -> str | None:
    """"old" or "new" when `state` is exactly one of the two copies of step 2, else None."""
    for name, want in (("old", tiny_state(2)), ("new", _new_state())):
        if model_equal(state["model"], want["model"]) and state["step"] == 2 and state["extra"] == want["extra"]:
            return name
    return None


def _next_run(root: Path) -> tuple[int, str | None]:
    """The next run: restore, then save step 3 under keep=2 (its retention pass runs)."""
    state = tiny_state(987654)
    with Checkpointer(root, handle_signals=False, retention=RetentionPolicy(keep=2)) as ck:
        step = ck.restore(state)
        copy = _which(state)
        ck.save(3, tiny_state(3))
    return step, copy


def _copies_of_step_2(root: Path) -> list[str]:
    """Directories under root that hold a committed copy of step 2 (any name)."""
    return sorted(p.name for p in root.iterdir() if p.name == step_dir_name(2) or
                  (p.name.startswith((SAVING_PREFIX, REPLACED_PREFIX)) and step_dir_name(2) in p.name
                   and (p / MARKER).exists()))


def _stranded(root: Path) -> list[str]:
    """Second copies of step 2 that nothing would ever remove: a parked old copy, or a committed
    save directory without the `.inprogress` note by which the leftovers rule judges its writer
    (one with the note of a killed writer is that rule's to remove, once idle: checked too)."""
    dead = set(leftovers.plan(leftovers.find(root), now=float("inf"), young_s=0))
    return [n for n in _copies_of_step_2(root) if n != step_dir_name(2) and n not in dead]


@pytest.fixture
def template(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ENV_LEASE_HEARTBEAT, "0.1")  # a killed child's lease ages out in 0.3 s
    monkeypatch.setenv(NO_EXCHANGE, "1")
    root = tmp_path / "template"
    save_steps(root, [1, 2]).close()
    return root


@pytest.mark.slow  # ~8 kills, each followed by a next run that restores, saves and prunes
def test_a_kill_at_any_point_of_a_replace_without_rename_exchange_keeps_the_step(
        template: Path, tmp_path: Path) -> None:
    trace = trace_of(lambda: _replace(shutil.copytree(template, tmp_path / "probe")), tmp_path / "trace.txt")
    start = trace.index("unlink.inprogress")  # the new copy is committed: from here on, two copies exist
    # (the lease's heartbeat thread writes `.owner` on its own clock: not a point of the replace)
    table = [seam_spec(trace, i) for i in range(start, len(trace)) if not trace[i].endswith(".owner")]
    assert any(s.startswith("rename.replace") for s in table), table  # the replace is in the table
    assert len([s for s in table if s.startswith("rename.")]) >= 3, table  # its renames, each a row
    failures = []
    for i, spec in enumerate(table):
        root = shutil.copytree(template, tmp_path / f"kill-{i}")
        code, sig = fork_call(lambda root=root: _replace(root), env={"SLURMRESUME_TEST_KILL_AT": spec},
                              out=tmp_path / "child.out")
        assert sig == signal.SIGKILL, (spec, code, (tmp_path / "child.out").read_text()[-2000:])
        left = _copies_of_step_2(root)
        step, copy = _next_run(root)
        after = inspect_dir(2, root / step_dir_name(2))
        extra = _stranded(root)
        row = f"kill at {spec} (left {left}): resumed step {step} ({copy} copy), step 2 complete {after.complete}, " \
              f"stranded second copies {extra}"
        if step != 2 or copy is None or not after.complete or extra:
            failures.append(row)
    assert not failures, "\n".join(failures)


def test_status_names_a_parked_copy_and_the_next_start_puts_it_back(tmp_path: Path) -> None:
    """The state a kill between the two renames leaves, made by hand: step 2 parked, its new
    copy committed beside it. `status` says so; the owner's next start puts the old copy back
    and drops the new one (the replace never reached its commit point)."""
    from typer.testing import CliRunner

    from slurmresume.cli import app

    root = tmp_path / "root"
    save_steps(root, [1, 2]).close()
    token = "0123456789abcdef"
    shutil.copytree(root / step_dir_name(2), root / f"{SAVING_PREFIX}{step_dir_name(2)}.{token}")
    parked = root / f"{REPLACED_PREFIX}{step_dir_name(2)}.{token}"
    (root / step_dir_name(2)).rename(parked)
    res = CliRunner().invoke(app, ["status", "--ckpt-dir", str(root)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert f"{parked.name} is the old copy of {step_dir_name(2)}" in res.output, res.output
    state = tiny_state(987654)
    with Checkpointer(root, handle_signals=False) as ck:
        assert ck.restore(state) == 2 and _which(state) == "old"
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".") and (p / MARKER).exists()) == []
    assert inspect_dir(2, root / step_dir_name(2), verify=True).complete

"""The checkpoint commands through typer's CliRunner, at a fixed terminal width."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest
import typer
from helpers.core import tiny_state
from helpers.procs import REPO
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import DELETING_PREFIX, step_dir_name
from slurmresume.checkpoint.store import list_checkpoints
from slurmresume.cli import app, shared
from slurmresume.tools import status
from slurmresume.tools.status import SLURM_NOT_FOUND

ENV = {"COLUMNS": "120", "TERM": "dumb", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""}


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)


def run(*args: str, env: dict | None = None, input: str | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={**ENV, **(env or {})}, input=input)


def save(root: Path, *steps: int) -> None:
    ckpt = Checkpointer(root, handle_signals=False)
    for s in steps:
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0 / (s + 1), "acc": s / 1000})
    ckpt.close()


def old_partial(root: Path, step: int, age: float = 3 * 86400) -> Path:
    d = root / step_dir_name(step)
    d.mkdir()
    (d / "rank-00000-of-00001.safetensors").write_bytes(b"x" * 10)
    t = time.time() - age
    for p in (d / "rank-00000-of-00001.safetensors", d):
        os.utime(p, (t, t))
    return d


def steps(root: Path) -> list[int]:
    return sorted(i.step for i in list_checkpoints(root))


def one_error_line(result, quiet: bool = True) -> str:
    """The one `error: ...` line on stderr; `quiet`: and nothing on stdout."""
    assert result.exit_code != 0, result.output
    assert result.stdout == "" or not quiet, result.stdout
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


# -- status -------------------------------------------------------------------------------------

def test_status_table(tmp_path):
    save(tmp_path, 9, 10, 100)
    old_partial(tmp_path, 200)
    r = run("status", "--ckpt-dir", tmp_path, "--best", "acc", "--mode", "max")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert SLURM_NOT_FOUND in out and out.splitlines()[1].startswith("HEALTHY")
    assert "incomplete" in out and "complete, newest, best" in out and "save_committed" in out
    table = out[out.index("checkpoints (newest first)"):]
    assert re.findall(r"^\s+(\d+)\s+(?:complete|incomplete)", table, re.M) == ["200", "100", "10", "9"]
    assert max(map(len, out.splitlines())) <= 120


def test_status_env_default_limit_and_verify(tmp_path):
    save(tmp_path, 1, 2, 3)
    r = run("status", "--limit", "1", "--verify", env={"SLURMRESUME_CKPT_DIR": str(tmp_path)})
    assert r.exit_code == 0, r.output
    assert "2 older checkpoint directories not shown (--limit 0 shows all)" in r.stdout and "ok" in r.stdout


def test_status_json(tmp_path):
    save(tmp_path, 1, 2)
    r = run("status", "-d", tmp_path, "--json", "--best", "loss", "--job", "123")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["schema"] == "slurmresume.tools.status/1" and data["newest_complete"] == 2
    assert data["best"]["step"] == 2 and data["job"]["job_id"] == "123"
    assert [c["step"] for c in data["checkpoints"]] == [2, 1]


@pytest.mark.parametrize("args,message", [
    (["--job", "12; rm -rf /"], "not a Slurm job id"),
    (["--best", "bleu"], "metric 'bleu'"),
    (["--watch", "0"], "more than 0"),
    (["--watch", "soon"], "not a duration"),
    (["--watch", "5", "--json"], "cannot be combined"),
    (["--limit", "-1"], "--limit"),
])
def test_status_bad_input(tmp_path, args, message):
    save(tmp_path, 1)
    assert message in one_error_line(run("status", "-d", tmp_path, *args))


def test_status_watch_redraws_until_ctrl_c(tmp_path, monkeypatch):
    save(tmp_path, 1)
    naps = []
    real, here = time.sleep, threading.get_ident()

    def sleep(seconds):  # this patches time.sleep for every thread of the worker process:
        if threading.get_ident() != here:  # another thread's nap (one an earlier test left
            return real(seconds)  # running) must not count, or the watch never gets its Ctrl-C
        naps.append(seconds)
        if len(naps) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr("slurmresume.cli.render_status.time.sleep", sleep)
    r = run("status", "-d", tmp_path, "--watch", "2s")
    assert r.exit_code == 0, r.output
    assert naps == [2.0, 2.0] and "checkpoints" in r.stdout


@pytest.mark.parametrize("command", ["status", "prune --keep 1", "verify", "latest"])
def test_unknown_or_missing_directory(tmp_path, command):
    assert "does not exist" in one_error_line(run(*command.split(), "--ckpt-dir", tmp_path / "nope"))
    assert "no checkpoint root" in one_error_line(run(*command.split()))
    (tmp_path / "file").write_text("x")
    assert "not a directory" in one_error_line(run(*command.split(), "-d", tmp_path / "file"))


# -- prune --------------------------------------------------------------------------------------

def test_prune_refuses_without_yes_when_not_a_tty(tmp_path):
    save(tmp_path, 9, 10, 100)
    r = run("prune", "--keep", "1", "-d", tmp_path)
    assert r.exit_code == 1
    assert "DELETE" in r.stdout and "pass --yes to delete without asking" in r.stderr
    assert steps(tmp_path) == [9, 10, 100]


def test_prune_yes_deletes_and_reports(tmp_path):
    save(tmp_path, 9, 10, 100)
    (tmp_path / f"{DELETING_PREFIX}step_000000001.dead").mkdir()
    r = run("prune", "--keep", "1", "-d", tmp_path, "--yes")
    assert r.exit_code == 0, r.output
    assert "deleted step_000000009" in r.stdout and "leftover" in r.stdout
    assert steps(tmp_path) == [100] and not list(tmp_path.glob(f"{DELETING_PREFIX}*"))
    r = run("prune", "--keep", "1", "-d", tmp_path, "--yes")
    assert r.exit_code == 0 and "nothing to delete" in r.stdout


def test_prune_dry_run_deletes_nothing(tmp_path):
    save(tmp_path, 1, 2, 3)
    r = run("prune", "--keep", "1", "-d", tmp_path, "--dry-run")
    assert r.exit_code == 0 and "dry run: nothing deleted" in r.stdout
    assert steps(tmp_path) == [1, 2, 3]


@pytest.mark.parametrize("answer,exit_code,left", [("y\n", 0, [3]), ("n\n", 1, [1, 2, 3])])
def test_prune_asks_on_a_tty(tmp_path, monkeypatch, answer, exit_code, left):
    save(tmp_path, 1, 2, 3)
    monkeypatch.setattr(shared, "_stdin_is_tty", lambda: True)
    r = run("prune", "--keep", "1", "-d", tmp_path, input=answer)
    assert r.exit_code == exit_code, r.output
    assert "Delete 2 entries listed above?" in r.stdout
    assert steps(tmp_path) == left


def test_prune_keep_every_and_best(tmp_path):
    save(tmp_path, *range(1, 9))
    r = run("prune", "--keep", "1", "--keep-every", "3", "--keep-best", "acc", "--mode", "min", "-d", tmp_path, "-y")
    assert r.exit_code == 0, r.output
    assert steps(tmp_path) == [1, 3, 6, 8]


def test_prune_incomplete_only_when_asked_and_old_enough(tmp_path):
    save(tmp_path, 1)
    old_partial(tmp_path, 50, age=3 * 86400)
    old_partial(tmp_path, 60, age=3600)
    assert run("prune", "--keep", "1", "-d", tmp_path, "-y").exit_code == 0
    assert steps(tmp_path) == [1, 50, 60]
    r = run("prune", "--keep", "1", "-d", tmp_path, "-y", "--remove-incomplete-older-than", "1d")
    assert r.exit_code == 0, r.output
    assert steps(tmp_path) == [1, 60]


def test_prune_json(tmp_path):
    save(tmp_path, 1, 2, 3)
    old_partial(tmp_path, 9)
    r = run("prune", "--keep", "2", "-d", tmp_path, "--json", "--dry-run")
    data = json.loads(r.stdout)
    assert data["schema"] == "slurmresume.prune/1" and data["dry_run"] is True
    assert set(data) == {"schema", "root", "dry_run", "policy", "plan", "newest_complete", "best",
                         "leftovers", "deleted", "skipped", "cleaned"}
    assert [(p["step"], p["action"]) for p in data["plan"]] == [(9, "keep"), (3, "keep"), (2, "keep"), (1, "delete")]
    assert data["policy"]["keep"] == 2 and data["deleted"] == []
    assert "pass --yes" in one_error_line(run("prune", "--keep", "2", "-d", tmp_path, "--json"))
    data = json.loads(run("prune", "--keep", "2", "-d", tmp_path, "--json", "--yes").stdout)
    assert data["deleted"] == [step_dir_name(1)] and steps(tmp_path) == [2, 3, 9]


@pytest.mark.parametrize("args,message", [
    (["--keep", "0"], "--keep must be an integer >= 1"),
    (["--keep", "-3"], "--keep must be an integer >= 1"),
    (["--keep", "1", "--keep-every", "0"], "--keep-every"),
    (["--keep", "1", "--keep-best", "bleu"], "no complete checkpoint records that metric; metrics found: acc, loss"),
    (["--keep", "1", "--remove-incomplete-older-than", "-1d"], "negative"),
    (["--keep", "1", "--remove-incomplete-older-than", "3 fortnights"], "not a duration"),
])
def test_prune_bad_input_deletes_nothing(tmp_path, args, message):
    save(tmp_path, 1, 2)
    old_partial(tmp_path, 5)
    assert message in one_error_line(run("prune", *args, "-d", tmp_path, "--yes"))
    assert steps(tmp_path) == [1, 2, 5]


def test_prune_refuses_a_symlinked_lock(tmp_path):
    save(tmp_path, 1, 2)
    (tmp_path / ".slurmresume.lock").unlink(missing_ok=True)
    (tmp_path / ".slurmresume.lock").symlink_to(tmp_path / step_dir_name(2) / "COMMITTED")
    assert "symbolic link" in one_error_line(run("prune", "--keep", "1", "-d", tmp_path, "--yes"), quiet=False)
    assert steps(tmp_path) == [1, 2]
    assert all(i.complete for i in list_checkpoints(tmp_path))


# -- verify and latest --------------------------------------------------------------------------

def test_verify_ok_step_and_all(tmp_path):
    save(tmp_path, 1, 2)
    r = run("verify", "-d", tmp_path)
    assert r.exit_code == 0 and "ok" in r.stdout and "step 2" in r.stdout and "step 1 " not in r.stdout
    assert "step 1" in run("verify", "1", "-d", tmp_path).stdout
    r = run("verify", "--all", "-d", tmp_path)
    assert r.exit_code == 0 and "step 1" in r.stdout and "step 2" in r.stdout


def test_verify_names_each_bad_file(tmp_path):
    save(tmp_path, 1, 2)
    for s in (1, 2):
        shard = tmp_path / step_dir_name(s) / "rank-00000-of-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[-2] ^= 0x40
        shard.write_bytes(bytes(data))
    r = run("verify", "--all", "-d", tmp_path)
    assert r.exit_code == 1 and r.stdout.count("FAIL") == 2
    line = r.stderr.strip()
    assert line.startswith("error: 2 of 2 checkpoint(s) failed verification")
    for s in (1, 2):
        assert str(tmp_path / step_dir_name(s) / "rank-00000-of-00001.safetensors") in line


@pytest.mark.parametrize("args,message", [
    (["3", "--all"], "not both"), (["7"], "no step 7"), (["5"], "incomplete"),
])
def test_verify_bad_input(tmp_path, args, message):
    save(tmp_path, 3)
    (tmp_path / step_dir_name(5)).mkdir()
    assert message in one_error_line(run("verify", *args, "-d", tmp_path))


def test_verify_and_latest_on_an_empty_root(tmp_path):
    assert "no complete checkpoint" in one_error_line(run("verify", "-d", tmp_path))
    assert "no complete checkpoint" in one_error_line(run("latest", "-d", tmp_path))


def test_latest_prints_the_path_only(tmp_path):
    save(tmp_path, 9, 10, 100)
    old_partial(tmp_path, 500)
    r = run("latest", env={"SLURMRESUME_CKPT_DIR": str(tmp_path)})
    assert r.exit_code == 0 and r.stdout == f"{tmp_path / step_dir_name(100)}\n" and r.stderr == ""


def test_latest_with_only_incomplete_dirs(tmp_path):
    old_partial(tmp_path, 1)
    one_error_line(run("latest", "-d", tmp_path))


def flip_a_byte(root: Path, step: int) -> Path:
    shard = root / step_dir_name(step) / "rank-00000-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-2] ^= 0x40
    shard.write_bytes(bytes(data))
    return shard


def test_verify_json_is_one_object_and_keeps_the_exit_code(tmp_path):
    """`verify --json` (#48.6): every checked checkpoint with its problems, one JSON object on
    stdout; a failing one still exits 1 with its `error:` line on stderr."""
    save(tmp_path, 1, 2)
    r = run("verify", "--all", "--json", "-d", tmp_path)
    assert r.exit_code == 0 and r.stderr == "", r.output
    assert json.loads(r.stdout) == {"schema": "slurmresume.verify/1", "root": str(tmp_path), "ok": True, "checkpoints": [
        {"step": s, "path": str(tmp_path / step_dir_name(s)), "ok": True, "unreadable": False, "problems": []}
        for s in (2, 1)]}  # newest first, as the text report
    shard = flip_a_byte(tmp_path, 2)
    r = run("verify", "--json", "-d", tmp_path)
    assert r.exit_code == 1 and r.stderr.startswith("error: 1 of 1 checkpoint(s) failed verification"), r.output
    doc = json.loads(r.stdout)
    assert doc["ok"] is False and [c["step"] for c in doc["checkpoints"]] == [2]
    assert str(shard) in doc["checkpoints"][0]["problems"][0]


def test_latest_json_names_the_step_and_what_verify_skipped(tmp_path):
    """`latest --json` (#48.6): step and path; with --verify the newer steps it passed over; with
    none, "path": null and exit 1 as without --json. The root also as -d, and positionally."""
    save(tmp_path, 1, 2)
    r = run("latest", "--json", "-d", tmp_path)
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout) == {"schema": "slurmresume.latest/1", "root": str(tmp_path), "step": 2,
                                    "path": str(tmp_path / step_dir_name(2)), "skipped": []}
    assert run("latest", tmp_path).stdout == run("latest", "-d", tmp_path).stdout == f"{tmp_path / step_dir_name(2)}\n"
    flip_a_byte(tmp_path, 2)
    doc = json.loads(run("latest", "--json", "--verify", "-d", tmp_path).stdout)
    assert doc["step"] == 1 and [s["path"] for s in doc["skipped"]] == [str(tmp_path / step_dir_name(2))]
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run("latest", "--json", "-d", empty)
    assert r.exit_code == 1 and r.stderr.startswith("error: no complete checkpoint"), r.output
    assert json.loads(r.stdout)["path"] is None


# -- help -----------------------------------------------------------------------------------------

def commands() -> dict:
    return typer.main.get_command(app).commands  # type: ignore[attr-defined]


def test_checkpoint_commands_are_registered():
    assert {"status", "prune", "verify", "latest"} <= set(commands())


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_has_help(name):
    cmd = commands()[name]
    assert cmd.help and len(cmd.help.strip()) > 20, name
    r = run(name, "--help")
    assert r.exit_code == 0 and "Usage" in r.stdout
    for param in cmd.params:
        if param.param_type_name == "option" and param.name != "help":
            assert getattr(param, "help", None), f"{name} {param.opts} has no help"


def test_every_command_is_in_the_readme():
    path = REPO / "README.md"
    assert path.exists(), "README.md is missing: it should show every command"
    readme = path.read_text()
    missing = [n for n in commands() if f"slurmresume {n}" not in readme]
    assert not missing, f"README.md does not mention: {missing}"

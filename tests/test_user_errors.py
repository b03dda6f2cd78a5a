"""Every user mistake is one line naming the thing and the fix, a non-zero exit, never a
traceback. One row per bad input (the table in docs/troubleshooting.md); each runs the real
`python -m slurmresume` in a subprocess, so typer's usage errors go through `cli.main` too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.core import tiny_state
from helpers.procs import REPO, clean_env

from slurmresume import Checkpointer

SCRIPT = REPO / "examples" / "train.py"
# Root without CAP_DAC_OVERRIDE: file modes apply to root as to anyone (tests run as root).
NO_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


def save(root: Path, *steps: int) -> Path:
    ckpt = Checkpointer(root, handle_signals=False)
    for s in steps:
        ckpt.save(s, tiny_state(s), metrics={"loss": 1.0 / (s + 1)})
    ckpt.close()
    return root


def cli(args: list[str], cwd: Path, env: dict[str, str] | None = None, wrap: list[str] | None = None,
        stdin: str = "") -> subprocess.CompletedProcess[str]:
    env = clean_env(PYTHONPATH=str(REPO), COLUMNS="200", NO_COLOR="1", **(env or {}))
    return subprocess.run([*(wrap or []), sys.executable, "-m", "slurmresume", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, input=stdin)


@dataclass
class Row:
    id: str
    setup: Callable[[Path], list[str]]  # -> argv, after preparing files under tmp_path
    message: str  # a fragment of the one error line (also listed in docs/troubleshooting.md)
    code: int = 1
    wrap: list[str] | None = None
    env: dict[str, str] | None = None


def _file(tmp: Path) -> Path:
    (tmp / "afile").write_text("x")
    return tmp / "afile"


def _readonly_root(tmp: Path) -> Path:
    root = save(tmp / "ro", 1)
    for p in [root, *root.rglob("*")]:
        p.chmod(0o555 if p.is_dir() else 0o444)
    return root


def _unreadable_step(tmp: Path) -> Path:
    tmp.chmod(0o755)
    root = save(tmp / "r", 1, 2, 3)
    (root / "step_000000002").chmod(0)
    return root


def _pyproject(tmp: Path, body: str) -> None:
    (tmp / "pyproject.toml").write_text(f"[tool.slurmresume]\n{body}\n")


ROWS = [
    Row("ckpt-dir is a file", lambda t: ["status", "--ckpt-dir", str(_file(t))], "is not a directory"),
    Row("ckpt-dir missing", lambda t: ["latest", "--ckpt-dir", str(t / "nope")], "does not exist"),
    Row("no root anywhere", lambda t: ["status"], "no checkpoint root"),
    Row("submit ckpt-dir is a file", lambda t: ["submit", str(SCRIPT), "--local", "--ckpt-dir", str(_file(t))],
        "is a file, not a directory"),
    Row("submit read-only root", lambda t: ["submit", str(SCRIPT), "--local", "--ckpt-dir", str(_readonly_root(t))],
        "is not writable", wrap=NO_DAC),
    Row("export --out a directory", lambda t: ["export", "latest", "-d", str(save(t / "r", 1)), "--out", str(t)],
        "is a directory: give a file name"),
    Row("export --out in a missing directory",
        lambda t: ["export", "latest", "-d", str(save(t / "r", 1)), "--out", str(t / "no" / "m.safetensors")],
        "does not exist: create it first"),
    Row("inspect an unreadable step", lambda t: ["inspect", "2", "-d", str(_unreadable_step(t))],
        "unreadable by this user", wrap=NO_DAC),
    Row("verify --all with an unreadable step", lambda t: ["verify", "--all", "-d", str(_unreadable_step(t))],
        "unreadable by this user", wrap=NO_DAC),
    Row("nodes = \"two\" in pyproject", lambda t: (_pyproject(t, 'nodes = "two"\nckpt-dir = "ck"'),
                                                  ["submit", str(SCRIPT), "--dry-run"])[1], "must be a whole number"),
    Row("ckpt-dir = 3 in pyproject", lambda t: (_pyproject(t, "ckpt-dir = 3"), ["status"])[1],
        "must be a quoted string"),
    Row("pyproject not TOML", lambda t: ((t / "pyproject.toml").write_text("[tool.slurmresume\n"), ["status"])[1],
        "is not valid TOML"),
    Row("unknown key in pyproject", lambda t: (_pyproject(t, 'ckpt-dir = "ck"\nnode = 2'),
                                              ["submit", str(SCRIPT), "--dry-run"])[1], "unknown key"),
    Row("submit without a root", lambda t: ["submit", str(SCRIPT), "--dry-run"], "no checkpoint directory"),
    Row("submit a missing script", lambda t: ["submit", str(t / "train.py"), "--dry-run", "--ckpt-dir", str(t / "ck")],
        "training script"),
    Row("submit --time nonsense", lambda t: ["submit", str(SCRIPT), "--dry-run", "--ckpt-dir", str(t),
                                             "--time", "1:99:99:99"], "is not a Slurm time"),
    Row("submit --signal nonsense", lambda t: ["submit", str(SCRIPT), "--dry-run", "--ckpt-dir", str(t),
                                               "--signal", "FOO"], "--signal 'FOO'"),
    Row("status --limit -1", lambda t: ["status", "-d", str(t), "--limit", "-1"], "--limit must be >= 0"),
    Row("status --limit abc", lambda t: ["status", "-d", str(t), "--limit", "abc"], "Invalid value for '--limit'",
        code=2),
    Row("status --watch 0", lambda t: ["status", "-d", str(t), "--watch", "0"], "more than 0"),
    Row("unknown option", lambda t: ["export", "--bogus"], "No such option:", code=2),
    Row("unknown command", lambda t: ["stauts"], "No such command", code=2),
    Row("prune --keep 0", lambda t: ["prune", "--keep", "0", "-d", str(save(t / "r", 1))], "--keep must be"),
    Row("prune in a pipe without --yes", lambda t: ["prune", "--keep", "1", "-d", str(save(t / "r", 1, 2))],
        "without confirmation"),
    Row("verify a missing step", lambda t: ["verify", "99", "-d", str(save(t / "r", 1))], "no step 99"),
    Row("inspect nonsense", lambda t: ["inspect", "foo", "-d", str(save(t / "r", 1))], "is not a step number"),
    Row("latest on an empty root", lambda t: ["latest", "-d", str(t)], "no complete checkpoint"),
    Row("drill --preemptions 0", lambda t: ["drill", str(SCRIPT), "--preemptions", "0"], "--preemptions", code=2),
    Row("submit --hang-timeout soon", lambda t: ["submit", str(SCRIPT), "--local", "--ckpt-dir", str(t / "r"),
                                                 "--hang-timeout", "soon"],
        "is not valid: use auto, off or a positive number of seconds"),
    Row("submit --max-hangs -1", lambda t: ["submit", str(SCRIPT), "--local", "--ckpt-dir", str(t / "r"), "--max-hangs",
                                            "-1"], "--max-hangs must be >= 0"),
    Row("drill --hang with --preemptions", lambda t: ["drill", str(SCRIPT), "--hang", "1", "--preemptions", "2",
                                                      "--workdir", str(t / "d")], "cannot be combined"),
    Row("doctor a missing script", lambda t: ["doctor", str(t / "train.py")], "training script"),
]


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input_is_one_line(row: Row, tmp_path: Path) -> None:
    if row.wrap and shutil.which(row.wrap[0]) is None:
        pytest.skip(f"{row.wrap[0]} not installed")
    args = row.setup(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = cli(args, tmp_path, row.env, row.wrap)
    assert proc.returncode == row.code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert row.message in lines[0], lines[0]
    if args and args[0] == "submit":  # nothing created before the error
        assert sorted(p.name for p in tmp_path.iterdir()) == before


def _nobin(tmp: Path) -> Path:
    """A PATH with bash and env but no Slurm command."""
    d = tmp / "bin"
    d.mkdir()
    for name in ("bash", "env"):
        os.symlink(shutil.which(name) or f"/bin/{name}", d / name)
    return d


@pytest.mark.slow
def test_dry_run_without_slurm_prints_the_script_and_creates_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    proc = cli(["submit", str(SCRIPT), "--dry-run", "--ckpt-dir", str(root)], tmp_path,
               {"PATH": str(_nobin(tmp_path))})
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --signal=USR1@120" in proc.stdout and "torchrun" in proc.stdout
    assert not root.exists()


@pytest.mark.slow
def test_unreadable_step_is_skipped_by_status_latest_and_prune(tmp_path: Path) -> None:
    root = _unreadable_step(tmp_path)
    st = cli(["status", "-d", str(root)], tmp_path, wrap=NO_DAC)
    assert st.returncode == 0 and "Traceback" not in st.stderr, st.stderr
    assert "step_000000002 is unreadable by this user" in st.stdout and "unreadable" in st.stdout
    latest = cli(["latest", "-d", str(root)], tmp_path, wrap=NO_DAC)
    assert latest.returncode == 0 and latest.stdout.strip().endswith("step_000000003")
    plan = cli(["prune", "--keep", "1", "--dry-run", "-d", str(root)], tmp_path, wrap=NO_DAC)
    assert plan.returncode == 0 and "Traceback" not in plan.stderr, plan.stderr
    assert (root / "step_000000002").exists()


def test_ckpt_dir_from_pyproject_for_every_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from slurmresume.cli import app
    from slurmresume.tools import status

    monkeypatch.setattr(status, "run_slurm", lambda args, timeout=10.0: None)
    save(tmp_path / "runs" / "exp1", 1, 2)
    _pyproject(tmp_path, 'ckpt-dir = "runs/exp1"')
    monkeypatch.chdir(tmp_path)
    env = {"SLURMRESUME_CKPT_DIR": "", "COLUMNS": "120", "NO_COLOR": "1"}
    for args in (["status"], ["latest"], ["verify", "--all"], ["inspect", "latest"], ["prune", "--keep", "1", "--dry-run"],
                 ["export", "latest", "--out", "m.safetensors"]):
        r = CliRunner().invoke(app, args, env=env)
        assert r.exit_code == 0, (args, r.output)
    assert (tmp_path / "m.safetensors").is_file()
    r = CliRunner().invoke(app, ["latest"], env=env)
    assert r.stdout.strip() == str(tmp_path / "runs" / "exp1" / "step_000000002")


@pytest.mark.slow
def test_submit_local_json_is_one_json_document(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    proc = cli(["submit", str(SCRIPT), "--local", "--json", "--ckpt-dir", str(root), "--", "--steps", "4",
                "--save-every", "2"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # the training output went to stderr
    assert result["action"] == "finish" and (root / "step_000000004" / "COMMITTED").exists()
    assert "slurmresume: saved step 4" in proc.stderr

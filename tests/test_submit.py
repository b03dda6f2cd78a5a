"""`submit`: the generated sbatch script and torchrun command (golden), option validation, and
command construction against a fake `sbatch` at the subprocess seam (PATH). The real proof that
submission works is tests/test_slurm_e2e.py against the real cluster."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from slurmresume.cli import app

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train.py"
GOLDEN = Path(__file__).parent / "golden" / "submit_dry_run.txt"


def invoke(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", **(env or {})})


def normalise(text: str, tmp: Path) -> str:
    return text.replace(str(tmp), "<TMP>").replace(sys.executable, "<PYTHON>").replace(str(REPO), "<REPO>")


def test_dry_run_matches_golden(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(tmp_path / "ck"), "--nodes", "2", "--gpus-per-node", "4",
                 "--cpus-per-task", "16", "--mem", "64G", "--time", "4:00:00", "--partition", "gpu", "--account",
                 "proj", "--qos", "high", "--job-name", "run1", "--signal-lead", "300", "--sbatch", "exclusive",
                 "--sbatch", "gres=gpu:4", "--dry-run", "--", "--steps", "100", "--lr", "3e-4")
    assert res.exit_code == 0, res.output
    got = normalise(res.output, tmp_path)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(got)
    assert got == GOLDEN.read_text()
    # the parts that matter, spelled out
    for line in ("#SBATCH --signal=USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=1", "#SBATCH --time=240", "#SBATCH --exclusive", "#SBATCH --gres=gpu:4",
                 "trap 'kill -s USR1 $SLURMRESUME_SRUN 2>/dev/null' USR1"):
        assert line in got
    assert "--nproc-per-node=4" in got and "--rdzv-backend=c10d" in got and "--steps 100 --lr 3e-4" in got
    assert not (tmp_path / "ck" / "events.jsonl").exists()  # a dry run submits nothing


def _fake_sbatch(bindir: Path, log: Path) -> None:
    bindir.mkdir()
    script = bindir / "sbatch"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\ncat \"$1\" >> {log}\necho 'Submitted batch job 4242'\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    srun = bindir / "srun"  # submitit looks for it (a machine without Slurm has none)
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)


def test_submit_builds_the_sbatch_call(tmp_path: Path) -> None:
    """Command construction only (fake sbatch at the PATH seam)."""
    log = tmp_path / "sbatch.log"
    _fake_sbatch(tmp_path / "bin", log)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(tmp_path / "ck"), "--json", env=env)
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    assert out["job_id"] == "4242" and out["dry_run"] is False
    called = log.read_text()
    assert called.splitlines()[0].endswith(".sh") and "#SBATCH --signal=USR1@120" in called and "#SBATCH --requeue" in called
    events = [json.loads(x) for x in (tmp_path / "ck" / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "submitted" and events[-1]["job"] == "4242" and events[-1]["signal_lead"] == 120


def test_defaults_from_pyproject_cli_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "pyproject.toml").write_text(
        '[tool.slurmresume]\nckpt-dir = "from-config"\npartition = "cfgpart"\nsignal-lead = 200\n')
    monkeypatch.chdir(tmp_path)
    res = invoke("submit", str(EXAMPLE), "--partition", "clipart", "--dry-run")
    assert res.exit_code == 0, res.output
    assert "#SBATCH --partition=clipart" in res.output and "#SBATCH --signal=USR1@200" in res.output
    assert str(tmp_path / "from-config") in res.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/train.py"], "not found"),
        ([str(EXAMPLE), "--python", "/no/such/python"], "interpreter"),
        ([str(EXAMPLE), "--partition", "gpu;rm -rf /"], "--partition"),
        ([str(EXAMPLE), "--time", "forever"], "not a Slurm time"),
        ([str(EXAMPLE), "--time", "1:2:3:4"], "not a Slurm time"),
        ([str(EXAMPLE), "--mem", "lots"], "--mem"),
        ([str(EXAMPLE), "--signal", "USR9"], "unknown signal"),
        ([str(EXAMPLE), "--nodes", "0"], "--nodes"),
        ([str(EXAMPLE), "--sbatch", "signal=USR2@5"], "set by slurmresume"),
        ([str(EXAMPLE), "--job-name", "a\nb"], "newline"),
        ([str(EXAMPLE), "--sbatch", "comment=x\n#SBATCH --wrap=evil"], "newline"),
        ([str(EXAMPLE), "--", "--lr", "1\nrm -rf ~"], "newline"),
        ([str(EXAMPLE), "--job-name", "a\u2028touch PWNED"], "control character"),  # Unicode line separator
        ([str(EXAMPLE), "--qos", "\x85x"], "control character"),  # C1 NEL
        ([str(EXAMPLE), "--", "\ufeffx"], "control character"),  # BOM (format character)
    ],
)
def test_bad_input_is_one_line_and_submits_nothing(tmp_path: Path, args: list[str], message: str) -> None:
    log = tmp_path / "sbatch.log"
    _fake_sbatch(tmp_path / "bin", log)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}
    argv = ["submit", *args[:1], "--ckpt-dir", str(tmp_path / "ck"), *args[1:]]
    res = invoke(*argv, env=env)
    assert res.exit_code != 0
    assert message in res.output
    assert not log.exists()  # sbatch never called
    assert not (tmp_path / "ck").exists()  # nothing written


def test_no_sbatch_on_path_says_use_local(tmp_path: Path) -> None:
    res = invoke("submit", str(EXAMPLE), "--ckpt-dir", str(tmp_path / "ck"), env={"PATH": str(tmp_path)})
    assert res.exit_code == 1
    assert "no sbatch on PATH: use --local to run here" in res.output

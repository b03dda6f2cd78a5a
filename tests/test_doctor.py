"""`slurmresume doctor` against the real cluster (a good configuration) and against a broken one
injected by a fake `scontrol` first on PATH that edits the real output (the shared cluster is
never reconfigured), plus pure checks on tables of inputs."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import REPO, clean_env

from slurmresume.tools import doctor as d

SCRIPT = REPO / "examples" / "train.py"
BAD_SCRIPT = """import slurmresume
ckpt = slurmresume.Checkpointer(save_every=10)
for step in range(100):
    pass
ckpt.save(100, {})
"""


def doctor(*args: str, path: str | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env(PYTHONPATH=str(REPO), COLUMNS="200", NO_COLOR="1")
    if path:
        env["PATH"] = f"{path}:{env['PATH']}"
    return subprocess.run([sys.executable, "-m", "slurmresume", "doctor", *args], env=env, capture_output=True,
                          text=True, timeout=120)


def root_with_saves(tmp: Path, seconds: float) -> Path:
    root = tmp / "root"
    root.mkdir()
    with open(root / "events.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"time": 1000.0 + 100 * i, "event": "save_committed", "step": 100 * (i + 1),
                                "seconds": seconds}) + "\n")
    return root


@pytest.fixture
def cluster() -> None:
    if os.environ.get("SLURMRESUME_NO_CLUSTER") or shutil.which("scontrol") is None:
        pytest.skip("no Slurm cluster on this machine")
    if subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        pytest.skip("slurmctld does not answer")


@pytest.mark.slurm
def test_doctor_on_the_real_cluster_is_clean(tmp_path, cluster):
    proc = doctor(str(SCRIPT), "--ckpt-dir", str(root_with_saves(tmp_path, 2.0)))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and "Traceback" not in proc.stderr
    for name in ("Slurm version: Slurm 22.05", "preemption: preempt/partition_prio, PreemptMode=REQUEUE",
                 "warning at preemption: the --signal warning is sent", "ProctrackType: proctrack/cgroup",
                 "KillWait: KillWait=5 s", "GraceTime (debug): GraceTime=20 s", "MaxTime (debug)",
                 "--signal-lead: 120 s vs slowest of the last 3 saves 2.0 s", "filesystem:", "script: train.py"):
        assert name in proc.stdout, name


FAKE_SCONTROL = """#!/bin/bash
# Test seam: the real scontrol, with a deliberately wrong configuration edited into its output.
out=$({real} "$@") || exit $?
echo "$out" | sed -e 's/^PreemptMode .*/PreemptMode             = CANCEL/' \\
  -e 's/^SlurmctldParameters .*/SlurmctldParameters     = (null)/' \\
  -e 's/^ProctrackType .*/ProctrackType           = proctrack\\/linuxproc/' \\
  -e 's/^KillWait .*/KillWait                = 1 sec/' \\
  -e 's/GraceTime=20/GraceTime=0/' -e 's/MaxTime=UNLIMITED/MaxTime=00:01:00/'
"""


@pytest.mark.slurm
def test_doctor_finds_every_wrong_setting(tmp_path, cluster):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(FAKE_SCONTROL.format(real=shutil.which("scontrol")))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    script = tmp_path / "train.py"
    script.write_text(BAD_SCRIPT)
    proc = doctor(str(script), "--ckpt-dir", str(root_with_saves(tmp_path, 30.0)), "--signal-lead", "20",
                  path=str(bin_dir))
    print(proc.stdout)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    out = proc.stdout
    for line in ("FAIL  preemption: PreemptMode=CANCEL", "warn  warning at preemption",
                 "warn  ProctrackType: proctrack/linuxproc", "warn  KillWait: KillWait=1 s",
                 "FAIL  GraceTime (debug): GraceTime=0 s", "warn  MaxTime (debug): MaxTime=00:01:00",
                 "FAIL  --signal-lead: 20 s vs slowest of the last 3 saves 30.0 s",
                 "FAIL  script: restore", "FAIL  script: step"):
        assert line in out, line
    assert out.count("fix: ") >= 9 and "13 checks: 5 failed, 4 warnings" in out


@pytest.mark.parametrize("source,verdicts", [
    (SCRIPT.read_text(), {"script": "ok"}),
    (BAD_SCRIPT, {"script: restore": "fail", "script: step": "fail"}),
    ("ckpt = Checkpointer()\nckpt.restore(s)\nckpt.step(1, s)\n", {"script: step": "warn"}),
    ("def f(:\n", {"script": "fail"}),
])
def test_script_checks(source, verdicts):
    got = {c.name: c.status for c in d.check_script(source, "t.py")}
    assert got == verdicts


@pytest.mark.parametrize("lead,saves,status", [(120, [], "ok"), (120, [2.0, 3.0], "ok"), (20, [8.0], "warn"),
                                               (20, [30.0], "fail")])
def test_signal_lead(lead, saves, status):
    assert d.check_lead(lead, saves, step_s=1.0).status == status


@pytest.mark.parametrize("mounts,status", [
    ("/dev/sda1 / ext4 rw 0 0\n", "ok"),
    ("/dev/sda1 / ext4 rw 0 0\nfs:/export /ckpt nfs4 rw 0 0\n", "warn"),
    ("/dev/sda1 / ext4 rw 0 0\nmds@o2ib:/lfs /ckpt lustre rw 0 0\n", "warn"),
])
def test_filesystem(mounts, status):
    assert d.check_filesystem(Path("/ckpt/run1"), mounts).status == status


def test_preflight_root_room_and_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(d.ConfigError, match="is a file, not a directory"):
        d.preflight_root(tmp_path / "f" / "run")
    with pytest.raises(d.ConfigError, match="GB free but the last checkpoint took"):
        d.preflight_root(tmp_path / "new", need_bytes=shutil.disk_usage(tmp_path).free * 2)
    d.preflight_root(tmp_path / "new", need_bytes=1)
    assert not (tmp_path / "new").exists()  # a check creates nothing

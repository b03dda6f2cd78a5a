"""A step another user wrote with umask 077 under a shared root is "unreadable by this user",
never "corrupt": `prune --remove-incomplete-older-than` keeps every byte of it, `latest` and a
restore refuse it with one line naming it rather than resume an older step past it.

Two users, for real: the step is written with umask 077 and owned by uid 65534 ("user A"); the
reading side ("user B") runs as a child without any capability, so the kernel applies the file
modes to it. B keeps uid 0 (stripped of CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and every other
capability) rather than becoming uid 65534 because this machine's Python and its packages live
under /root (mode 700), which no other uid may enter. Needs root to chown and drop capabilities.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.core import save_steps, step_dir
from helpers.procs import REPO, clean_env

from slurmresume.checkpoint.layout import DELETING_PREFIX, SAVING_PREFIX

USER_A = 65534
# user B: this uid, no capability at all (bounding and inheritable sets emptied before the exec)
AS_USER_B = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
TWO_DAYS = 2 * 86400

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root (to chown a step to another uid, then drop every "
                                       "capability) and setpriv")

RESTORE = """
import json, sys
sys.path.insert(0, sys.argv[2])
from helpers.core import tiny_state
from slurmresume import Checkpointer
from slurmresume.errors import SlurmResumeError
try:
    step = Checkpointer(sys.argv[1], handle_signals=False).restore(tiny_state(987654))
    print(json.dumps({"step": step}))
except SlurmResumeError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


def _as_user_a(step: Path, readable: str) -> None:
    """Step directory `step` becomes user A's; what stays readable to others: "nothing" (what
    umask 077 left: directory 700, files 600), "all but the files" (a directory opened by hand:
    755), "all but the shard" (its one shard file 600)."""
    for p in [step, *step.iterdir()]:
        os.lchown(p, USER_A, USER_A)
    if readable != "nothing":
        step.chmod(0o755)
    if readable == "all but the shard":
        for p in step.iterdir():
            p.chmod(0o600 if p.suffix == ".safetensors" else 0o644)


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _as_b(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env(PYTHONPATH=str(REPO), COLUMNS="200", NO_COLOR="1", SLURMRESUME_CKPT_DIR="")
    return subprocess.run([*AS_USER_B, sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("readable", ["nothing", "all but the files", "all but the shard"])
def test_another_users_step_is_never_deleted_skipped_or_called_corrupt(tmp_path: Path, readable: str) -> None:
    root = tmp_path / "shared"
    save_steps(root, [1]).close()  # an older step everyone can read
    umask = os.umask(0o077)
    try:
        save_steps(root, [2]).close()  # user A's newest step
    finally:
        os.umask(umask)
    old = time.time() - TWO_DAYS  # idle long past any age rule
    for p in [*root.rglob("*"), root]:
        os.utime(p, (old, old), follow_symlinks=False)
    _as_user_a(step_dir(root, 2), readable)
    mine = _files(step_dir(root, 2))
    if subprocess.run([*AS_USER_B, "true"], capture_output=True).returncode != 0:
        pytest.skip("setpriv cannot drop the capabilities here (no CAP_SETPCAP?)")
    probe = subprocess.run([*AS_USER_B, "cat", str(step_dir(root, 2) / "rank-00000-of-00001.safetensors")],
                           capture_output=True, text=True)
    assert "Permission denied" in probe.stderr, f"user B can read user A's shard: the test would prove nothing {probe}"

    pruned = _as_b(["-m", "slurmresume", "prune", "--keep", "2", "--remove-incomplete-older-than", "0",
                    "--yes", "-d", str(root)], tmp_path)
    assert pruned.returncode == 0 and "Traceback" not in pruned.stderr, pruned.stderr
    assert "corrupt" not in pruned.stdout, pruned.stdout
    assert _files(step_dir(root, 2)) == mine  # still there, under its name, every byte
    assert not [p.name for p in root.iterdir() if p.name.startswith((DELETING_PREFIX, SAVING_PREFIX))]
    assert step_dir(root, 1).is_dir()

    got = _as_b(["-c", RESTORE, str(root), str(REPO / "tests")], tmp_path)
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout.strip().splitlines()[-1])
    assert result.get("error") == "UnreadableCheckpointError", result  # not step 1, not a fresh start
    message = result["message"]
    assert "\n" not in message and "step_000000002" in message and "unreadable by this user" in message, message

    latest = _as_b(["-m", "slurmresume", "latest", "-d", str(root)], tmp_path)
    if readable == "all but the shard":  # its marker is readable: it is committed, and that is all `latest` says
        assert latest.returncode == 0 and latest.stdout.strip() == str(step_dir(root, 2)), latest.stderr
    else:
        lines = latest.stderr.strip().splitlines()
        assert latest.returncode == 1 and latest.stdout == "", (latest.stdout, latest.stderr)
        assert len(lines) == 1 and lines[0].startswith("error: ") and "step_000000002" in lines[0], lines
        assert "unreadable by this user" in lines[0], lines
    if readable == "nothing":  # what restore will do, said where a user looks first
        st = _as_b(["-m", "slurmresume", "status", "-d", str(root)], tmp_path)
        said = " ".join(st.stdout.split())
        assert st.returncode == 3 and "AT RISK step_000000002 is unreadable by this user" in said, st.stdout
        assert "restore refuses it" in said and "skipped" not in said, said
    assert _files(step_dir(root, 2)) == mine

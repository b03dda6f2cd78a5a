"""Two containers on one host share its name and boot id but not their pids (issue #45): a pid
is judged only from its own pid namespace and boot, with its start time. Real pid namespaces
(`unshare --pid --fork --mount-proc`, root only), small child processes that call the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.procs import clean_env

from slurmresume import identity, ownership
from slurmresume.checkpoint import leftovers
from slurmresume.checkpoint.layout import INPROGRESS, saving_dir_name


def _unshare_works() -> bool:
    try:
        return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not _unshare_works(), reason="needs root and util-linux unshare (pid namespaces)")


def _in_namespace(code: str, *args: str, **env: str) -> subprocess.Popen[str]:
    """`code` run by pid 1 of a new pid namespace (with its own /proc), on this host and boot."""
    return subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", code, *args],
                            env=clean_env(**env), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _run_in_namespace(code: str, *args: str) -> str:
    proc = _in_namespace(code, *args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return out.strip()


HOLD = """
import os, sys
from slurmresume import ownership
holder = ownership.hold(sys.argv[1], sys.argv[2])
print(os.getpid(), flush=True)
sys.stdin.readline()
print("held" if holder.still_held() else "lost", flush=True)
holder.release()
"""

TAKE = """
import os, sys
from slurmresume import ownership
try:
    ownership.acquire(sys.argv[1], sys.argv[2])
except ownership.RootOwnedError as exc:
    print("refused", os.getpid(), exc)
else:
    print("took", os.getpid())
"""


def test_the_same_pid_in_another_namespace_does_not_take_a_fresh_lease(tmp_path: Path) -> None:
    """A `submit --local` launcher holds the root as pid 1 of its container; a second launcher, also
    pid 1 (of another container), once read the lease as "held by this same process" and took it
    at once, while its heartbeat was a second old."""
    root = tmp_path / "root"
    first = _in_namespace(HOLD, str(root), "local-first")
    try:
        assert first.stdout.readline().strip() == "1", first.stderr.read() if first.poll() is not None else ""
        lease = ownership.read_lease(root)
        assert lease is not None and lease.pid == 1 and lease.pid_ns not in (0, identity.pid_namespace())
        said = _run_in_namespace(TAKE, str(root), "local-second")
        assert said.startswith("refused 1 ") and "local run pid 1" in said, said
        assert json.loads((root / ownership.OWNER).read_text())["owner"] == "local-first"
        out, err = first.communicate("go\n", timeout=60)
        assert out.strip() == "held", err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


CLAIM = """
import os, sys
from slurmresume.ownership import RootOwnedError
from slurmresume.train import claims
try:
    key = claims.for_checkpointer(sys.argv[1], creating=True)
except RootOwnedError as exc:
    print("refused", exc, flush=True)
    raise SystemExit(0)
print("claimed", key[1], flush=True)
if sys.argv[2] == "hold":
    sys.stdin.readline()
    claims.before_save(sys.argv[1], key)  # raises when the lease was taken meanwhile
    print("still the owner", flush=True)
    claims.unclaim(key)
"""


def test_two_bare_checkpointers_in_two_containers_never_share_one_lease(tmp_path: Path) -> None:
    """A bare Checkpointer's owner id was host name + pid: the second container's pid 1 had the
    first one's owner id, renewed the first run's lease as its own and would have saved into the
    root beside it."""
    root = tmp_path / "root"
    first = _in_namespace(CLAIM, str(root), "hold")
    try:
        line = first.stdout.readline().strip()
        assert line.startswith("claimed local-"), first.stderr.read() if first.poll() is not None else line
        said = _run_in_namespace(CLAIM, str(root), "once")
        assert said.startswith("refused") and "local run pid 1" in said, said
        assert json.loads((root / ownership.OWNER).read_text())["owner"] == line.split()[1]
        out, err = first.communicate("go\n", timeout=60)
        assert out.strip() == "still the owner", err[-3000:]
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert not (root / ownership.OWNER).exists()


JUDGE = """
import sys
from slurmresume import ownership
verdict = ownership.judge(ownership.read_lease(sys.argv[1]))
print(verdict.state, verdict.why)
"""


def test_a_pid_of_another_namespace_is_neither_dead_nor_alive_only_its_heartbeat_counts(tmp_path: Path) -> None:
    """A live process of the host's pid namespace holds the lease, its heartbeat 100 s old; from a
    container, where no process has its pid, the pid once proved it dead (taken over without a
    flag). Now only the heartbeat speaks there: not old enough (alive), then over 10 min (stale:
    --takeover only), never proven. From the holder's own namespace its pid still proves it alive."""
    root = tmp_path / "root"
    root.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        lease = ownership.new_lease("local-on-the-host", pid=holder.pid)
        assert lease.pid_start and lease.pid_ns == identity.pid_namespace()
        for age, state in ((100, "alive"), (700, "stale")):
            with ownership._lock(root):
                (root / ownership.OWNER).write_text(json.dumps(replace(lease, heartbeat=time.time() - age).__dict__))
            state_there, why = _run_in_namespace(JUDGE, str(root)).split(" ", 1)
            assert state_there == state and "another pid namespace's (another container)" in why, (age, why)
            assert ownership.judge(ownership.read_lease(root)).state == "alive"  # here its pid runs
    finally:
        holder.kill()
        holder.wait()
    assert ownership.judge(ownership.read_lease(root)).state == "proven"  # and here its death is proof


WRITER = """
import os, sys
from pathlib import Path
from slurmresume.checkpoint import leftovers
from slurmresume.checkpoint.layout import INPROGRESS
if sys.argv[2] != "0":  # the writer's pid in this namespace: one the host has no process with
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(int(sys.argv[2]) - 1))
    child = os.fork()
    if child:
        os.waitpid(child, 0)
        raise SystemExit(0)
d = Path(sys.argv[1])
d.mkdir()
(d / INPROGRESS).write_bytes(leftovers.note())
os.utime(d / INPROGRESS, (0, 0))
os.utime(d, (0, 0))
print(os.getpid(), flush=True)
sys.stdin.readline()
"""

CLEAN = """
import sys
from slurmresume.checkpoint import leftovers
print(leftovers.writer_dead(__import__("pathlib").Path(sys.argv[1]) / sys.argv[2]))
leftovers.clean(sys.argv[1], young_s=0)
"""


def _free_pid() -> int:
    """A pid no process of the host's namespace has now."""
    return next(p for p in range(30000, 20000, -1) if not os.path.exists(f"/proc/{p}"))


def test_a_live_writer_in_a_container_is_not_dead_to_a_prune_on_the_host(tmp_path: Path) -> None:
    """A save in a container writes `.saving.*` as pid P of its namespace; on the host no process
    has pid P. The host's clean-up (prune, the next save) asked kill(P, 0) here, found nothing and
    removed the directory the live writer was filling."""
    root = tmp_path / "root"
    root.mkdir()
    d = root / saving_dir_name(7, "0" * 16)
    pid = _free_pid()
    writer = _in_namespace(WRITER, str(d), str(pid))
    try:
        assert writer.stdout.readline().strip() == str(pid), writer.stderr.read() if writer.poll() else ""
        note = json.loads((d / INPROGRESS).read_bytes())
        assert note["pid"] == pid and note["pid_ns"] not in (0, identity.pid_namespace()) and note["boot_id"]
        assert not leftovers.writer_dead(d)
        leftovers.clean(root, young_s=0)
        assert (d / INPROGRESS).exists()
    finally:
        writer.communicate("done\n", timeout=60)


def test_a_live_writer_on_the_host_is_not_dead_to_a_prune_in_a_container(tmp_path: Path) -> None:
    """The other way round: this process writes the note; in a container, its pid names no one."""
    root = tmp_path / "root"
    root.mkdir()
    d = root / saving_dir_name(8, "0" * 16)
    d.mkdir()
    (d / INPROGRESS).write_bytes(leftovers.note())
    for p in (d / INPROGRESS, d):
        os.utime(p, (0, 0))
    assert _run_in_namespace(CLEAN, str(root), d.name) == "False"
    assert (d / INPROGRESS).exists()


FOREIGN_PROC = """
import os, sys
from pathlib import Path
from slurmresume.checkpoint import leftovers
from slurmresume.checkpoint.layout import INPROGRESS
d = Path(sys.argv[1])
ready_r, ready_w = os.pipe()
done_r, done_w = os.pipe()
child = os.fork()
if child == 0:  # pid 2 of this namespace: the writer
    d.mkdir()
    (d / INPROGRESS).write_bytes(leftovers.note())
    os.write(ready_w, b"x")
    os.read(done_r, 1)
    os._exit(0)
os.read(ready_r, 1)
print(child, leftovers.writer_dead(d), flush=True)
os.write(done_w, b"x")
os.waitpid(child, 0)
"""


def test_a_proc_of_another_namespace_proves_nothing(tmp_path: Path) -> None:
    """`unshare --pid --fork` without --mount-proc: the new namespace sees the host's /proc, where
    pid 2 is someone else (started at another time): the live writer would have looked dead."""
    d = tmp_path / saving_dir_name(6, "0" * 16)
    proc = subprocess.run(["unshare", "--pid", "--fork", sys.executable, "-c", FOREIGN_PROC, str(d)],
                          env=clean_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["2", "False"]


def test_a_dead_writer_of_this_namespace_is_still_proven_dead(tmp_path: Path) -> None:
    """The rule still removes what a killed writer of this namespace left (note: pid, start time,
    pid namespace, boot)."""
    root = tmp_path / "root"
    root.mkdir()
    d = root / saving_dir_name(9, "0" * 16)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(d), "0"], env=clean_env(), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert writer.stdout.readline().strip() == str(writer.pid), writer.stderr.read()
    assert not leftovers.writer_dead(d)
    writer.kill()
    writer.wait()
    assert leftovers.writer_dead(d)
    leftovers.clean(root, young_s=0)
    assert not d.exists()


def test_a_save_notes_its_writer_with_boot_pid_namespace_and_start_time(tmp_path: Path) -> None:
    from slurmresume.checkpoint.commit import discard, prepare

    root = tmp_path / "root"
    made = prepare(root, 3)
    assert made.action == "write", made
    note = json.loads((root / made.dir / INPROGRESS).read_bytes())
    assert identity.ProcessId.from_record(note) == identity.this_process()
    discard(root / made.dir)

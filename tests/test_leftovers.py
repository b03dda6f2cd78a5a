"""Directories killed writers leave (issue #27): a save's `.saving.*` and a mirror download's
`.mirror-download.*` hold the bytes written so far. The root's owner removes those whose writer is
provably dead (a pid on this host that exited) and that are idle past the young threshold, at its
next save and in `prune`; `status` lists the rest with their size."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from typer.testing import CliRunner

from slurmresume import Checkpointer
from slurmresume.checkpoint import leftovers
from slurmresume.checkpoint.layout import INPROGRESS
from slurmresume.cli import app
from slurmresume.retention import RetentionPolicy, execute

OLD = time.time() - 7200


def _plant(root: Path, name: str, *, pid: int, host: str | None = None, mtime: float = OLD) -> Path:
    """A killed or live writer's directory; its note names process `pid` of this pid namespace
    (as `leftovers.note` writes it), or one on `host` (another boot id)."""
    d = root / name
    d.mkdir(parents=True)
    (d / "rank-00000-of-00001.safetensors").write_bytes(b"\0" * (1 << 20))
    note = json.loads(leftovers.note(pid))
    if host is not None:
        note.update(host=host, boot_id=f"boot-of-{host}")
    (d / INPROGRESS).write_text(json.dumps(note))
    for p in (*d.iterdir(), d):
        os.utime(p, (mtime, mtime))
    return d


def test_plan_removes_only_dead_and_idle() -> None:
    found = [leftovers.Leftover("a", 0.0, True), leftovers.Leftover("b", 0.0, False),
             leftovers.Leftover("c", 950.0, True)]
    assert leftovers.plan(found, now=1000.0, young_s=600.0) == ["a"]


def test_the_next_save_and_prune_remove_what_dead_writers_left_status_lists_the_rest(tmp_path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    root = tmp_path / "root"
    try:
        with Checkpointer(root, handle_signals=False) as ck:
            ck.save(1, {"w": torch.ones(2)})
            gone = [_plant(root, ".saving.step_000000009.00000000000000aa", pid=dead.pid),
                    _plant(root, ".mirror-download.step_000000012.1.deadbeef", pid=dead.pid)]
            kept = [_plant(root, ".saving.step_000000010.00000000000000bb", pid=live.pid),  # still writing
                    _plant(root, ".saving.step_000000011.00000000000000cc", pid=dead.pid, mtime=time.time()),  # young
                    _plant(root, ".saving.step_000000013.00000000000000dd", pid=dead.pid, host="elsewhere")]
            ck.save(2, {"w": torch.ones(2)})
            assert not any(d.exists() for d in gone)
            assert all(d.exists() for d in kept)
        res = CliRunner().invoke(app, ["status", "--ckpt-dir", str(root)], env={"COLUMNS": "250"})
        assert res.exit_code == 0, res.output
        for d in kept:
            assert f"{d.name} holds 1.0 MiB" in res.output
        live.kill()
        live.wait()
        os.utime(kept[1], (OLD, OLD))
        for p in kept[1].iterdir():
            os.utime(p, (OLD, OLD))
        result = execute(root, RetentionPolicy(keep=5))
        assert sorted(result.cleaned) == sorted(d.name for d in kept[:2])
        assert kept[2].exists()  # another host: never provably dead from here
    finally:
        live.kill()
        live.wait()


def test_last_activity_of_a_file_or_a_link_is_its_own_mtime(tmp_path) -> None:
    """Retention asks it of every entry, files and links too (a link's target is never read)."""
    f = tmp_path / "step_000000001"
    f.write_bytes(b"not a directory")
    os.utime(f, (OLD, OLD))
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "fresh").write_bytes(b"x")
    link = tmp_path / "step_000000002"
    link.symlink_to(target)
    os.utime(link, (OLD, OLD), follow_symlinks=False)
    assert leftovers.last_activity(f) == OLD
    assert leftovers.last_activity(link) == OLD
    assert leftovers.last_activity(tmp_path / "gone") >= time.time() - 5  # vanished: fresh, never old


def test_retention_and_the_leftovers_judge_a_writer_note_by_one_rule(tmp_path: Path) -> None:
    """A note from another boot of this host names a pid that, in this boot, means nothing: the
    writer is not provably dead (it may be a same-named host sharing the root), so neither the
    leftovers' clean-up nor retention may treat its directory as abandoned. A reused pid (alive
    now, another boot) and a live writer of this boot: alive both ways; a dead pid of this boot:
    dead both ways. Retention once judged a note without the boot id. Another pid namespace, or a
    note without one (an older version's): never dead."""
    from slurmresume.checkpoint.layout import step_dir_name
    from slurmresume.checkpoint.store import inspect_dir
    from slurmresume.identity import boot_id, pid_namespace
    from slurmresume.retention import record_from_info

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = pid_namespace()
    cases = {  # (pid, boot id, pid namespace) -> provably dead
        (gone.pid, "another-boot", here): False,
        (os.getpid(), "another-boot", here): False,  # a reused pid
        (os.getpid(), boot_id(), here): False,
        (gone.pid, boot_id(), here): True,
        (gone.pid, boot_id(), here + 1): False,  # another container's pid: not dead from here (#45)
        (gone.pid, boot_id(), None): False,  # a note written before the namespace was: unknown
    }
    for i, ((pid, boot, namespace), dead) in enumerate(cases.items()):
        d = tmp_path / step_dir_name(i + 1)
        d.mkdir()
        note = {"pid": pid, "host": socket.gethostname(), "boot_id": boot, "pid_ns": namespace, "started": OLD}
        (d / INPROGRESS).write_text(json.dumps({k: v for k, v in note.items() if v is not None}))
        record = record_from_info(inspect_dir(i + 1, d))
        assert (leftovers.writer_dead(d), not record.in_progress) == (dead, dead), (pid, boot, namespace)


# -- issue #45: a clean-up reports only what it actually removed --------------------------------

def _undeletable(d: Path) -> Callable[[], None] | None:
    """Make the file in `d` impossible to remove (a read-only directory; for root, which ignores
    modes, the immutable attribute). Returns how to undo it, or None where neither works here."""
    if os.geteuid() != 0:
        d.chmod(0o500)
        return lambda: d.chmod(0o700)
    f = next(d.iterdir())
    if subprocess.run(["chattr", "+i", str(f)], capture_output=True).returncode != 0:
        return None
    return lambda: subprocess.run(["chattr", "-i", str(f)], check=True)


def test_clean_reports_neither_what_another_cleaner_took_nor_what_it_could_not_remove(tmp_path, monkeypatch) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = tmp_path / "root"
    taken = _plant(root, ".saving.step_000000009.00000000000000aa", pid=dead.pid)
    stuck = _plant(root, ".saving.step_000000010.00000000000000bb", pid=dead.pid)
    gone = _plant(root, ".saving.step_000000011.00000000000000cc", pid=dead.pid)
    (stuck / "sub").mkdir()
    (stuck / "sub" / "part").write_bytes(b"x")
    undo = _undeletable(stuck / "sub")
    real_find = leftovers.find

    def find_then_lose_one(*args, **kwargs):  # another prune hides `taken` right after this listing
        found = real_find(*args, **kwargs)
        taken.rename(root / f".deleting.{taken.name}.0f0f0f0f")
        return found

    monkeypatch.setattr(leftovers, "find", find_then_lose_one)
    try:
        removed = leftovers.clean(root, young_s=600)
    finally:
        if undo is not None:
            undo()
    assert not gone.exists() and (root / f".deleting.{taken.name}.0f0f0f0f").exists()
    assert sorted(removed) == sorted([gone.name] + ([stuck.name] if undo is None else []))
    assert stuck.exists() == (undo is not None)


def test_prune_reports_only_the_partial_deletions_it_removed(tmp_path, monkeypatch) -> None:
    from slurmresume import retention

    root = tmp_path / "root"
    names = [".deleting.step_000000001.aaaaaaaa", ".deleting.step_000000002.bbbbbbbb", ".deleting.step_000000003.cc"]
    for name in names:
        (root / name / "sub").mkdir(parents=True)
        (root / name / "sub" / "part").write_bytes(b"x")
    undo = _undeletable(root / names[1] / "sub")
    real_list = retention.leftovers

    def list_then_lose_one(r):  # another prune removes the first one right after this listing
        found = real_list(r)
        subprocess.run(["rm", "-rf", str(r / names[0])], check=True)
        return found

    monkeypatch.setattr(retention, "leftovers", list_then_lose_one)
    try:
        cleaned = retention.clean_leftovers(root)
    finally:
        if undo is not None:
            undo()
    assert sorted(cleaned) == sorted([names[2]] + ([names[1]] if undo is None else []))
    assert (root / names[1]).exists() == (undo is not None) and not (root / names[2]).exists()

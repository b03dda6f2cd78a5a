"""Campaign 2: disk full in every phase of a save.

A small tmpfs (`mount -t tmpfs -o size=...,nr_inodes=...`, unmounted at the end) is the
checkpoint root. Step 1 is committed; then a filler file leaves exactly F bytes free, F swept
page by page (tmpfs allocates 4 KiB pages) from 0 until the save of step 2 fits, so ENOSPC hits
the `.inprogress` note, the shard's first and middle pages, the manifest and the marker in turn
(both with O_DIRECT and with SLURMRESUME_NO_ODIRECT=1 buffered writes). The same sweep runs over
free inodes (empty filler files), so file creation fails at each file. A file system that reports
ENOSPC only at fsync (NFS, ext4 delalloc writeback) cannot be made with tmpfs: for that phase
os.fsync is patched to fail once with ENOSPC at the fsync of each file of the save in turn.

The phase is the last seam label crossed before the failure (SLURMRESUME_TEST_TRACE).

Per trial: with on_save_error="raise" the save raises SaveError, one line, naming the file and
saying the bytes free and needed; no marker for step 2; step 1 verifies and restores exactly; no
`.*.tmp.*` file is left; the failed step's files hold no space. With on_save_error="warn",
Checkpointer.step() logs and training continues; after the filler goes, the next save succeeds.
`--count` repeats the whole sweep with seeded extra tensor sizes (the default, 1, runs it once).
Needs root (mount); otherwise the run is skipped, saying why.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
import stat
import subprocess
from contextlib import suppress
from pathlib import Path
from typing import Any

from campaigns.harness import LogCapture, Report, armed, temp_leftovers

NAME = "diskfull"
DEFAULT_COUNT = 3
PAGE = 4096
SIZE = 2 << 20  # the tmpfs


def mount_tmpfs(mnt: Path, size: int, inodes: int = 4096) -> str | None:
    """None when mounted; else why not (the campaign is then skipped)."""
    mnt.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "not root: mounting a tmpfs needs root (run as root, or in CI where scripts/test runs as root)"
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes},mode=0755", "tmpfs",
                           str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"mount -t tmpfs refused: {proc.stderr.strip() or proc.returncode}"
    return None


def umount(mnt: Path) -> None:
    subprocess.run(["umount", str(mnt)], capture_output=True)


def _state(step: int, extra: int) -> dict[str, Any]:
    import torch
    from helpers.core import tiny_state

    st = tiny_state(step)
    st["big"] = torch.full((10_000 + extra,), float(step))  # ~40 KiB: ENOSPC can land mid-shard
    return st


def _free(path: Path) -> tuple[int, int]:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, st.f_favail


def _fill(mnt: Path, leave_bytes: int | None = None, leave_inodes: int | None = None) -> None:
    """Fill the tmpfs so that exactly `leave_bytes` (a page multiple) / `leave_inodes` stay free."""
    filler = mnt / "filler"
    filler.mkdir(exist_ok=True)
    if leave_bytes is not None:
        free, _ = _free(mnt)
        take = free - leave_bytes
        if take > 0:
            with open(filler / f"bytes{len(os.listdir(filler))}", "wb") as f:
                f.write(b"\0" * take)
    if leave_inodes is not None:
        _, ino = _free(mnt)
        for i in range(ino - leave_inodes):
            (filler / f"i{i}").touch()


def _unfill(mnt: Path) -> None:
    shutil.rmtree(mnt / "filler", ignore_errors=True)


# The save's file fsyncs in commit order, by temp-file name. The shard's and its index's run on
# two threads at once, so "the n-th fsync call" names either under load: the n-th file does not.
FSYNCED = (".inprogress.tmp", ".safetensors.tmp", ".index.json.tmp", ".manifest.json.tmp", ".COMMITTED.tmp")


class FsyncENOSPC:
    """os.fsync that fails once with ENOSPC for the n-th file of FSYNCED (a file system that
    reports a full disk at writeback, as NFS and ext4 with delayed allocation do)."""

    def __init__(self, n: int) -> None:
        self.target, self.real, self.raised = FSYNCED[n - 1], os.fsync, False

    def __enter__(self) -> FsyncENOSPC:
        def fsync(fd: Any) -> None:
            if stat.S_ISDIR(os.fstat(fd).st_mode):  # directory fsyncs need no data blocks
                return self.real(fd)
            if not self.raised and self.target in os.readlink(f"/proc/self/fd/{fd}"):
                self.raised = True
                raise OSError(errno.ENOSPC, "No space left on device")
            self.real(fd)

        os.fsync = fsync
        return self

    def __exit__(self, *exc: object) -> None:
        os.fsync = self.real


def _phase(trace: Path, exc: BaseException | None, op: str | None = None) -> str:
    """Which file the failed save was creating or writing, and the last seam label crossed. `op`
    when known otherwise: the shard's fsync runs on a thread beside the index file's write, so
    the last label crossed may be the index's when the shard's (simulated) fsync fails."""
    labels = trace.read_text().split() if trace.exists() else []
    save = labels[labels.index("write.inprogress"):] if "write.inprogress" in labels else labels
    last = save[-1] if save else "-"
    m = re.search(r"while writing (\S+?)(?: \(|: )", str(exc))
    name = Path(m.group(1)).name if m else "?"
    kind = ("step dir" if name.startswith(("root", "step_")) else "shard" if name.endswith(".safetensors")
            else name)
    if kind == "step dir":
        return f"step dir (mkdir; after {last})"
    op = op or ("fsync" if last.startswith("fsync.") else "write" if last.startswith("write.") else "create")
    return f"{kind} ({op}; after {last})"


def _reset(root: Path, events: bytes) -> None:
    """Back to: step 1 committed, the event log as it was after step 1."""
    from slurmresume.checkpoint.layout import step_dir_name

    for p in root.iterdir():
        if p.name.startswith(("step_", ".deleting.")) and p.name != step_dir_name(1):
            shutil.rmtree(p, ignore_errors=True)
    (root / "events.jsonl").write_bytes(events)


def _guarantees(report: Report, trial: str, root: Path, exc: BaseException | None, extra: int,
                expect_enospc: bool = True) -> None:
    from helpers.core import model_equal, tiny_model

    from slurmresume import Checkpointer
    from slurmresume.checkpoint.layout import MARKER, step_dir_name
    from slurmresume.checkpoint.store import inspect_dir
    from slurmresume.errors import SaveError

    msg = str(exc) if exc is not None else ""
    if not report.check(isinstance(exc, SaveError), trial,
                        f"expected SaveError, got {type(exc).__name__ if exc else 'success'}: {msg}"):
        return
    report.check("\n" not in msg, trial, f"message is not one line: {msg!r}")
    report.check(str(root) in msg, trial, f"message does not name the path: {msg}")
    if expect_enospc:
        report.check("bytes free" in msg and ("bytes needed" in msg or "no free inodes" in msg), trial,
                     f"message does not say the space free and needed: {msg}")
    d = root / step_dir_name(2)
    report.check(not (d / MARKER).exists(), trial, "a marker was written for the failed step")
    left = [p.name for p in d.iterdir() if p.name.endswith(".safetensors") or p.name == "manifest.json"] \
        if d.is_dir() else []
    report.check(not left, trial, f"the failed save's files still hold space: {left}")
    tmp = temp_leftovers(root)
    report.check(not tmp, trial, f"temp files left: {tmp}")
    info = inspect_dir(1, root / step_dir_name(1), verify=True)
    report.check(info.complete and info.verified is True, trial, f"step 1 damaged: {info.problem}")
    state = _state(987654, extra)
    with Checkpointer(root, handle_signals=False) as ck:  # closed: an open one keeps its lease beating into root
        step = ck.restore(state)
    report.check(step == 1 and model_equal(state["model"], tiny_model(1)) and torch_equal(state["big"], 1, extra),
                 trial, f"restore gave step {step} / wrong data")


def torch_equal(t: Any, step: int, extra: int) -> bool:
    import torch

    return bool(torch.equal(t, torch.full((10_000 + extra,), float(step))))


def _attempt(root: Path, extra: int, trace: Path, mode: str) -> BaseException | None:
    from slurmresume import Checkpointer
    trace.unlink(missing_ok=True)
    with armed({"SLURMRESUME_TEST_TRACE": str(trace)}):
        try:
            ck = Checkpointer(root, handle_signals=False)
            ck.save(2, _state(2, extra))
            ck.close()
        except BaseException as exc:  # noqa: BLE001
            return exc
    return None


def _warn_mode(report: Report, trial: str, root: Path, mnt: Path, extra: int, fill: dict[str, int]) -> None:
    """on_save_error="warn": step() logs and returns; after space is freed the next save works."""
    from slurmresume import Checkpointer
    from slurmresume.checkpoint.store import find_latest

    _fill(mnt, **fill)
    ck = Checkpointer(root, handle_signals=False, save_every=1, on_save_error="warn")
    with LogCapture() as logs:
        try:
            ck.step(2, _state(2, extra))
        except BaseException as exc:  # noqa: BLE001
            report.fail(trial, f"warn mode raised {type(exc).__name__}: {exc}")
            _unfill(mnt)
            return
    report.check(any("training continues" in m for m in logs.messages), trial, f"no warning logged: {logs.messages}")
    _unfill(mnt)
    try:
        ck.step(3, _state(3, extra))
    except BaseException as exc:  # noqa: BLE001
        report.fail(trial, f"warn mode: the save after freeing space failed: {exc}")
        return
    ck.close()
    latest = find_latest(root, verify=True, warn=False)
    report.check(latest is not None and latest.step == 3, trial, f"after freeing space newest is {latest and latest.step}")


def sweep(report: Report, mnt: Path, rng: random.Random, rep: int) -> None:
    from slurmresume import Checkpointer
    from slurmresume.checkpoint.layout import step_dir_name

    extra = 0 if rep == 0 else rng.randrange(0, 3000)
    root = mnt / "root"
    shutil.rmtree(root, ignore_errors=True)
    _unfill(mnt)
    ck = Checkpointer(root, handle_signals=False)
    ck.save(1, _state(1, extra))
    ck.close()
    events = (root / "events.jsonl").read_bytes()
    trace = mnt.parent / "trace.txt"
    phases: dict[str, int] = {}
    for mode in ("odirect", "buffered"):
        os.environ.pop("SLURMRESUME_NO_ODIRECT", None)
        if mode == "buffered":
            os.environ["SLURMRESUME_NO_ODIRECT"] = "1"
        for kind in ("bytes", "inodes"):
            for leave in range(0, 64):
                _reset(root, events)
                fill = {"leave_bytes": leave * PAGE} if kind == "bytes" else {"leave_inodes": leave}
                _fill(mnt, **fill)
                exc = _attempt(root, extra, trace, mode)
                _unfill(mnt)
                if exc is None:  # it fits now: the sweep is over
                    report.check((root / step_dir_name(2) / "COMMITTED").exists(), f"{kind}={leave}", "no marker")
                    break
                phase = _phase(trace, exc)
                trial = f"rep {rep} {mode} {kind} free={leave}{'p' if kind == 'bytes' else ''} ({phase})"
                report.trials += 1
                phases[f"{kind}: {phase}"] = phases.get(f"{kind}: {phase}", 0) + 1
                is_enospc = isinstance(exc.__cause__ or exc, OSError) or "no space" in str(exc)
                _guarantees(report, trial, root, exc, extra, expect_enospc=is_enospc)
                report.check("no space left on device" in str(exc), trial, f"not reported as ENOSPC: {exc}")
                if kind == "inodes":
                    report.check("no free inodes" in str(exc), trial, f"inode exhaustion not said: {exc}")
                if leave % 3 == 0 or not phase.startswith("shard (write"):
                    _reset(root, events)
                    _warn_mode(report, trial + " warn", root, mnt, extra, fill)
            else:
                report.fail(f"{mode} {kind}", "the save never fitted")
        # ENOSPC reported by fsync (simulated): the fsync of each file of the save in turn fails
        for n in range(1, len(FSYNCED) + 1):
            _reset(root, events)
            with FsyncENOSPC(n) as failing:
                exc = _attempt(root, extra, trace, mode)
            phase = _phase(trace, exc, "fsync" if failing.raised else None)
            trial = f"rep {rep} {mode} fsync#{n} ENOSPC ({phase})"
            if not failing.raised:
                report.fail(trial, f"the save fsynced no {failing.target} file")
            report.trials += 1
            phases[f"fsync: {phase}"] = phases.get(f"fsync: {phase}", 0) + 1
            _guarantees(report, trial, root, exc, extra)
    os.environ.pop("SLURMRESUME_NO_ODIRECT", None)
    report.stats.setdefault("phases", {})
    for k, v in phases.items():
        report.stats["phases"][k] = report.stats["phases"].get(k, 0) + v
    _event_log_page(report, root, mnt, events, extra, rep)


def _event_log_page(report: Report, root: Path, mnt: Path, events: bytes, extra: int, rep: int) -> None:
    """Another job fills the disk between our commit (or our failed save) and the event-log
    append that follows it, while the log sits at a page boundary: the append gets a real ENOSPC.
    The save must still report what happened to the checkpoint (committed / SaveError)."""
    import slurmresume.events as cp  # every event append of a save goes through events.append_event
    from slurmresume import Checkpointer
    from slurmresume.checkpoint.layout import step_dir_name

    pad = PAGE - len(events) % PAGE
    body = events + b"\n" * pad  # blank lines: read_events skips them
    real = cp.append_event

    def filled_first(root_: Path, name: str, /, **fields: Any) -> None:
        if name in ("save_committed", "save_failed"):
            _fill(mnt, leave_bytes=0)
        real(root_, name, **fields)

    for outcome in ("committed", "failed"):
        _reset(root, body)
        if outcome == "failed":
            _fill(mnt, leave_bytes=2 * PAGE)  # room for .inprogress, not for the shard
        trial = f"rep {rep} event log full right after a {outcome} save"
        report.trials += 1
        cp.append_event = filled_first
        try:
            if outcome == "committed":
                with Checkpointer(root, handle_signals=False) as ck:  # closed: an open one keeps its lease beating into root
                    ck.save(2, _state(2, extra))
            else:  # a periodic save in warn mode: training must go on
                with Checkpointer(root, handle_signals=False, save_every=1, on_save_error="warn") as ck:  # closed: an open one keeps its lease beating into root
                    ck.step(2, _state(2, extra))
            exc: BaseException | None = None
        except BaseException as e:  # noqa: BLE001
            exc = e
        finally:
            cp.append_event = real
            _unfill(mnt)
        marked = (root / step_dir_name(2) / "COMMITTED").exists()
        if outcome == "committed":
            report.check(marked, trial, "the save did not commit")
            report.check(exc is None, trial, f"a committed save raised because the event log is full: {exc!r}")
        else:
            report.check(not marked, trial, "a marker for the failed save")
            report.check(exc is None, trial, f"warn mode raised because the event log is full: {exc!r}")
    _reset(root, events)


def run(report: Report, work: Path) -> None:
    mnt = work / "mnt"
    why = mount_tmpfs(mnt, SIZE, inodes=256)
    if why:
        report.skipped = why
        return
    try:
        rng = random.Random(report.seed)
        for rep in range(max(1, report.count)):
            sweep(report, mnt, rng, rep)
    finally:
        with suppress(Exception):
            _unfill(mnt)
        umount(mnt)


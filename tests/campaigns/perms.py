"""Campaign 9: permissions of what slurmresume creates, under umask 022 and 077 (the guarantee)
and 027, 002, 000 (same rule, reported).

A forked child with the umask set saves into a root that does not exist yet, three levels below
an existing directory (so that the parents are created too), saves again, fails a save on purpose
(the failed step's directory stays), prunes (the lock file), appends to the event log, and runs
`submit --dry-run` (which creates nothing since issue 15: the log directory of a real submit is
made by the same `makedirs` as the root). Then every path it created is checked:

  directories  mode within 0o755 less the umask
  files        mode within 0o644 less the umask

so nothing is ever group- or world-writable, and a stricter umask (077) is respected by every
file, the lock file included. --count repeats the set (the default does it once per umask).
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

from campaigns.harness import REPO, Report, arm, fork_call, tail

NAME = "perms"
DEFAULT_COUNT = 1
GUARANTEED = (0o022, 0o077)
REPORTED = (0o027, 0o002, 0o000)


def _actions(base: Path) -> None:
    from helpers.core import tiny_state
    from typer.testing import CliRunner

    from slurmresume import Checkpointer, RetentionPolicy
    from slurmresume.cli import app
    from slurmresume.events import append_event

    root = base / "a" / "b" / "root"
    ck = Checkpointer(root, handle_signals=False, retention=RetentionPolicy(keep=1))
    ck.save(1, tiny_state(1))
    ck.save(2, tiny_state(2))
    arm({"SLURMRESUME_TEST_FAIL_AT": "write.manifest"})
    try:
        ck.save(3, tiny_state(3))
    except Exception:  # noqa: BLE001 - the failure is the point
        pass
    arm(None)
    ck.close()
    append_event(base / "x" / "events-only", "note")
    res = CliRunner().invoke(app, ["submit", str(REPO / "examples" / "train.py"), "--ckpt-dir", str(base / "sub" / "ck"),
                                   "--dry-run"])
    assert res.exit_code == 0, res.output


def _import_once() -> None:
    """Import here what every child's actions import (torch, the CLI and submit's path): a forked
    child inherits the modules. Each of the five children imported them again, ~3 s of its ~4 s.
    Importing writes nothing under a child's base; torch starts no thread before its first op."""
    import torch
    from typer.testing import CliRunner  # noqa: F401

    from slurmresume.cli import app  # noqa: F401
    from slurmresume.job import submit, submitflow  # noqa: F401
    from slurmresume.tools import preflight  # noqa: F401

    torch.set_num_threads(1)  # forked children must not inherit a thread pool (as in crash.py)


def _check(report: Report, base: Path, umask: int, guaranteed: bool) -> None:
    trial = f"umask {umask:03o}"
    for dirpath, dirnames, filenames in os.walk(base):
        for name in dirnames + filenames:
            p = Path(dirpath, name)
            st = p.lstat()
            if stat.S_ISLNK(st.st_mode):
                continue
            mode = stat.S_IMODE(st.st_mode)
            allowed = (0o755 if stat.S_ISDIR(st.st_mode) else 0o644) & ~umask
            rel = p.relative_to(base)
            report.trials += 1
            if mode & ~allowed:
                ours = not str(rel).startswith("sub/ck/logs/")  # submitit writes its own files there
                what = f"{rel} is {mode:03o}, more than {allowed:03o}"
                if not ours:
                    report.stats.setdefault("submitit_files", {})[f"{umask:03o}"] = what
                elif guaranteed:
                    report.fail(trial, what)
                else:
                    report.fail(trial, what + " (a permissive umask; same rule)")
            report.stats.setdefault("modes", {}).setdefault(f"{umask:03o}", {})[str(rel)] = f"{mode:03o}"


def run(report: Report, work: Path) -> None:
    _import_once()
    for rep in range(max(1, report.count)):
        for umask in (*GUARANTEED, *REPORTED):
            base = work / f"u{umask:03o}-{rep}"
            shutil.rmtree(base, ignore_errors=True)
            base.mkdir(parents=True)
            os.chmod(base, 0o755)

            def child(base: Path = base, umask: int = umask) -> None:
                os.umask(umask)
                _actions(base)

            code, sig = fork_call(child, out=work / "child.out")
            if code != 0:
                report.fail(f"umask {umask:03o}", f"child failed {code}/{sig}: {tail(work / 'child.out')}")
                continue
            _check(report, base, umask, umask in GUARANTEED)


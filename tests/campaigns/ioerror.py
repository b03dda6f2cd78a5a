"""Campaign 3: an I/O error (EIO) at every file-system step of a save and of a prune.

The scenarios of the crash campaign (save, save over a stale partial, save + retention, prune,
two ranks, async save), traced once; then, for every label crossing, the same action runs in
this process with SLURMRESUME_TEST_FAIL_AT=label:N (the seam raises OSError(EIO) there), on a
fresh copy of the scenario's root. Deletions inside rmtree are points too ("rmtree.file").
Each save scenario runs twice per point: a direct save (on_save_error="raise") and a periodic
save through Checkpointer.step() with on_save_error="warn".

Guarantees: a failed save raises SaveError (one line, naming the file and the error) and writes
no marker; its files are removed, no new temp file is left; every previously complete
checkpoint still verifies and the newest restores exactly; in warn mode training goes on; a
failure in retention after a commit never fails the save (the checkpoint is complete); a failed
prune raises CheckpointError naming what it could not delete, deletes nothing protected, and
the next prune finishes; the next save succeeds. An EIO that is swallowed is allowed only when
the checkpoint it concerned is complete and verifies.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from campaigns import crash as cc
from campaigns.harness import (
    LogCapture,
    Report,
    armed,
    check_survivors,
    complete_steps,
    seam_spec,
    temp_leftovers,
    trace_of,
)

NAME = "ioerror"
DEFAULT_COUNT = 1  # repetitions of the full label matrix (it is deterministic)
PRUNE_LABELS = ("rename.delete.prune", "fsyncdir.delete.prune", "rmtree.file")


def _in_process(fn: Any, env: dict[str, str]) -> BaseException | None:
    real = shutil.rmtree
    try:
        with armed(env):
            cc._install_dying_rmtree()
            fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    finally:
        shutil.rmtree = real
    return None


def _warn_action(sc: cc.Scenario) -> Any:
    """The scenario's save as a periodic save in warn mode (None when it is not a save)."""
    if sc.new is None or sc.world != 1:
        return None
    new = sc.new

    def act(root: Path) -> None:
        from helpers.core import tiny_state

        from slurmresume import Checkpointer, RetentionPolicy
        kw: dict[str, Any] = {"retention": RetentionPolicy(keep=sc.keep)} if sc.keep else {}
        ck = Checkpointer(root, handle_signals=False, save_every=new, on_save_error="warn",
                          async_save=sc.name == "async", **kw)
        ck.step(new, tiny_state(new), metrics={"step": new})
        if sc.name == "async":  # the background error is handled at the next step
            while ck._async.in_flight():
                time.sleep(0.001)
            ck.step(new + 1, tiny_state(new + 1))
        ck.close()

    return act


def _check(report: Report, trial: str, root: Path, sc: cc.Scenario, label: str, exc: BaseException | None,
           tmp_before: set[str], warn: bool, logs: list[str]) -> None:
    from slurmresume.checkpoint.layout import MANIFEST, MARKER, step_dir_name
    from slurmresume.errors import CheckpointError, SaveError
    from slurmresume.retention import RetentionPolicy, execute, leftovers

    done = check_survivors(report, trial, root, sc.committed, sc.keep)
    new_done = sc.new in done if sc.new is not None else None
    msg = str(exc) if exc is not None else ""
    if exc is None:
        if sc.new is not None:
            # swallowed: only acceptable when the step is complete, or (warn mode) it was logged
            if new_done:
                report.count_stat("swallowed_but_committed")
            elif warn and any("training continues" in m for m in logs):
                report.count_stat("warn_mode_continued")
            else:
                report.fail(trial, f"EIO at {label} swallowed and step {sc.new} not committed")
        elif label not in ("rmtree.file",):
            report.fail(trial, f"prune: EIO at {label} swallowed")
    elif sc.new is not None:
        if not report.check(isinstance(exc, SaveError), trial, f"escaped as {type(exc).__name__}: {msg}"):
            return
        report.check("\n" not in msg, trial, f"message not one line: {msg!r}")
        report.check("injected I/O error" in msg and str(root) in msg, trial, f"message does not say what/where: {msg}")
        d = root / step_dir_name(sc.new)
        report.check(not (d / MARKER).exists(), trial, "marker present after SaveError")
        files = [p.name for p in d.iterdir() if p.name.endswith(".safetensors") or p.name == MANIFEST] if d.is_dir() else []
        report.check(not files or sc.name == "save-over-stale" and label.startswith(("rename.delete.stale",)),
                     trial, f"the failed save left {files}")
        report.count_stat("save_error")
    else:
        report.check(isinstance(exc, CheckpointError) and "cannot delete" in msg, trial,
                     f"prune failure escaped as {type(exc).__name__}: {msg}")
        report.count_stat("prune_error")
    new_tmp = {t for t in temp_leftovers(root) if not t.startswith(".deleting.")} - tmp_before
    report.check(not new_tmp, trial, f"new temp files: {sorted(new_tmp)}")
    newest = max(done) if done else None
    if newest is not None:
        bad = cc._data_ok(root, newest, sc.world, verify=True)
        if bad:
            report.count_stat("partial_loads")
        report.check(bad is None, trial, f"restore: {bad}")
    # the next save / prune succeeds
    try:
        if sc.new is None:
            execute(root, RetentionPolicy(keep=sc.keep or 1, remove_incomplete_older_than=3600))
            report.check(complete_steps(root) == sc.final and not leftovers(root), trial,
                         f"next prune: {complete_steps(root)}, leftovers {leftovers(root)}")
        elif not new_done:
            if sc.world == 1:
                cc._save(root, [sc.new], **({"retention": RetentionPolicy(keep=sc.keep)} if sc.keep else {}))
            else:
                cc.save_world(root, sc.new, sc.world)
            bad = cc._data_ok(root, sc.new, sc.world, verify=True)
            report.check(bad is None, trial, f"after the next save: {bad}")
    except Exception as e:  # noqa: BLE001
        report.fail(trial, f"the next save/prune failed: {type(e).__name__}: {e}")


def matrix(report: Report, work: Path) -> None:
    for sc in cc._scenarios():
        template = work / f"tpl-{sc.name}"
        shutil.rmtree(template, ignore_errors=True)
        sc.setup(template)
        probe = work / f"trace-{sc.name}"
        shutil.rmtree(probe, ignore_errors=True)
        shutil.copytree(template, probe, symlinks=True)

        def traced(sc: cc.Scenario = sc, probe: Path = probe) -> None:
            cc._install_dying_rmtree()
            sc.action(probe)

        trace = trace_of(traced, work / f"trace-{sc.name}.txt")
        tmp_before = set(temp_leftovers(template))
        actions = [("raise", sc.action)] + ([("warn", w)] if (w := _warn_action(sc)) else [])
        for i in range(len(trace)):
            spec = seam_spec(trace, i)
            for mode, action in actions:
                trial = f"{sc.name}/{mode}@{i}:{spec}"
                root = work / f"eio-{sc.name}-{mode}-{i}"
                shutil.rmtree(root, ignore_errors=True)
                shutil.copytree(template, root, symlinks=True)
                with LogCapture() as logs:
                    exc = _in_process(lambda root=root, action=action: action(root),
                                      {"SLURMRESUME_TEST_FAIL_AT": spec})
                report.trials += 1
                _check(report, trial, root, sc, trace[i], exc, tmp_before, mode == "warn", list(logs.messages))
                shutil.rmtree(root, ignore_errors=True)


def run(report: Report, work: Path) -> None:
    for rep in range(max(1, report.count)):
        matrix(report, work / f"rep{rep}")
    report.stats.setdefault("partial_loads", 0)


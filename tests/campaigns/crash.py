"""Campaign 1: crash at every boundary, then at random.

Part A, the boundary matrix (fixed size, ~200 kills): for each scenario below, trace the seam
labels one run crosses (SLURMRESUME_TEST_TRACE), then SIGKILL a forked child at every single
crossing (SLURMRESUME_TEST_KILL_AT=label:N), each on a fresh copy of the scenario's root.
Deletions inside shutil.rmtree are extra kill points ("rmtree.file", one per file removed).

  save              steps 1, 2 committed; save step 3
  save-over-stale   as `save`, but a killed save left a partial step 3 (moved aside first)
  save+retention    steps 1-3 committed; save step 4 with RetentionPolicy(keep=2)
  prune             steps 1-4, an old incomplete dir, a leftover .deleting.*; prune --keep 1
  world2            step 1 committed by 2 ranks; save step 2 as 2 ranks (rank 1's shard too)
  async             steps 1, 2 committed; Checkpointer(async_save=True).step(3) (background thread)
  replace           steps 1, 2 committed; a final save of step 2 with other weights replaces it
                    (kills from the moment its new copy is committed: the save before is `save`'s)
  replace-nox       the same without renameat2(RENAME_EXCHANGE), as on NFS/Lustre/GPFS
                    (SLURMRESUME_TEST_NO_RENAME_EXCHANGE=1): the replace takes two renames

For the two replace scenarios the checks run after the next run's start (a Checkpointer opened
and closed, which settles an interrupted replace: checkpoint/replace.py); step 2 must then be
exactly the old or the new copy, and no second copy of it may be left behind.

Part B, random kills (--count of them): a forked child trains a real model (MLP + Adam,
deterministic batches) with Checkpointer.step saving every step, in one of five variants
(sync, async, emergency: SIGUSR1 then SIGKILL during the emergency save, retention keep=2;
final-nox: after each periodic save a final save of the same step with a changed plain value
replaces it, without RENAME_EXCHANGE), and is SIGKILLed after a seeded random delay. Trials
chain on one root (each child resumes from what the previous kill left), so a resume after a
kill is itself tested; after a final-nox kill the checks follow the next run's start.

After every kill: no directory with a marker fails verification; no checkpoint committed before
the kill is missing (committed = complete before the trial, or a `save_committed` event; with
retention only what the policy keeps must stay); restore returns the newest complete step,
which is the step being saved or the previous committed one, with exactly the data saved for it
(a mismatch counts as a partial load); restore with verify=True agrees; the next save (or
prune) succeeds and verifies.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from campaigns.harness import (
    Report,
    age_lease,
    check_survivors,
    complete_steps,
    fork_call,
    half_checkpoints,
    seam_spec,
    tail,
    temp_leftovers,
    trace_of,
)

from slurmresume.contract import ENV_LEASE_HEARTBEAT

NAME = "crash"
DEFAULT_COUNT = 1000  # random kills in a full run (the boundary matrix is always complete)


# -- shared: rmtree with a kill point per file, tiny states -----------------------------------

def _install_dying_rmtree() -> None:
    """In a child: shutil.rmtree through the seam, one "rmtree.file" point before each unlink
    (deepest first, the marker last: the worst order for a reader)."""
    import slurmresume.checkpoint.fsio as fsio

    def rmtree(path: Any, ignore_errors: bool = False, onerror: Any = None, **_: Any) -> None:
        try:
            for dirpath, dirnames, filenames in os.walk(path, topdown=False):
                for name in sorted(filenames, reverse=True):
                    p = os.path.join(dirpath, name)
                    fsio.fault_point("rmtree.file", p)
                    os.unlink(p)
                for name in dirnames:
                    p = os.path.join(dirpath, name)
                    if os.path.islink(p):
                        os.unlink(p)
                    else:
                        os.rmdir(p)
            os.rmdir(path)
        except OSError:
            if not ignore_errors:
                raise

    shutil.rmtree = rmtree  # type: ignore[assignment]


def _save(root: Path, steps: list[int], **kw: Any) -> None:
    from helpers.core import tiny_state

    from slurmresume import Checkpointer
    ck = Checkpointer(root, handle_signals=False, **kw)
    for s in steps:
        ck.save(s, tiny_state(s), metrics={"step": s})
    ck.close()


def save_world(root: Path, step: int, world: int) -> None:
    """helpers.core.save_as_world, but a failed prepare raises SaveError as Checkpointer does
    (every rank's shard written in this process through prepare / write_rank / commit)."""
    from helpers.core import save_as_world

    from slurmresume.checkpoint import commit
    from slurmresume.checkpoint.reports import PrepareDecision
    from slurmresume.errors import SaveError

    real = commit.prepare

    def prepare(root: Path, step: int, replace: bool = False) -> PrepareDecision:
        decision = real(root, step, replace=True) if replace else real(root, step)
        if decision.action == "error":
            raise SaveError(f"checkpoint save failed, nothing committed: {decision.error}")
        return decision

    commit.prepare = prepare
    try:
        save_as_world(root, step, world)
    finally:
        commit.prepare = real


def _make_old_partial(root: Path, step: int) -> None:
    from slurmresume.checkpoint.layout import shard_name, step_dir_name

    d = root / step_dir_name(step)
    d.mkdir(parents=True)
    (d / shard_name(0, 1)).write_bytes(b"\0" * 300)
    t = time.time() - 7 * 86400
    for p in (*d.iterdir(), d):
        os.utime(p, (t, t))


# -- part A: the boundary matrix ----------------------------------------------------------------

@dataclass
class Scenario:
    name: str
    setup: Callable[[Path], None]
    action: Callable[[Path], object]
    committed: list[int]  # complete before the action
    new: int | None  # the step the action saves (None: a prune)
    keep: int | None = None  # retention keep N (None: nothing may be deleted)
    world: int = 1
    final: list[int] = field(default_factory=list)  # prune: what must remain after the next prune
    replaced: bool = False  # the action replaces step `new` (committed before) with _final_state
    exchange: bool = True  # False: renameat2(RENAME_EXCHANGE) unavailable (NO_EXCHANGE)
    from_label: str | None = None  # kill only from the first crossing of this label on


def _scenarios() -> list[Scenario]:
    from helpers.core import save_as_world

    from slurmresume.retention import RetentionPolicy, execute

    def stale_setup(root: Path) -> None:
        _save(root, [1, 2])
        # the killed writer's lease beats every 0.1 s: whoever takes the root next (the ioerror
        # campaign's traced run, at the default 30 s interval) waits 0.5 s for it to age, not 90 s
        code, sig = fork_call(lambda: _save(root, [3]), env={"SLURMRESUME_TEST_KILL_AT": "rename.marker",
                                                              ENV_LEASE_HEARTBEAT: "0.1"})
        assert sig == signal.SIGKILL, (code, sig)

    def prune_setup(root: Path) -> None:
        _save(root, [1, 2, 3, 4])
        _make_old_partial(root, 7)
        junk = root / ".deleting.step_000000005.deadbeef"
        junk.mkdir()
        (junk / "rank-00000-of-00001.safetensors").write_bytes(b"x" * 10)

    def world2_setup(root: Path) -> None:
        save_as_world(root, 1, 2)

    def async_action(root: Path) -> None:
        from helpers.core import tiny_state

        from slurmresume import Checkpointer
        ck = Checkpointer(root, handle_signals=False, save_every=1, async_save=True)
        ck.step(3, tiny_state(3), metrics={"step": 3})
        ck.close()

    return [
        Scenario("save", lambda r: _save(r, [1, 2]), lambda r: _save(r, [3]), [1, 2], 3),
        Scenario("save-over-stale", stale_setup, lambda r: _save(r, [3]), [1, 2], 3),
        Scenario("save+retention", lambda r: _save(r, [1, 2, 3]),
                 lambda r: _save(r, [4], retention=RetentionPolicy(keep=2)), [1, 2, 3], 4, keep=2),
        Scenario("prune", prune_setup,
                 lambda r: execute(r, RetentionPolicy(keep=1, remove_incomplete_older_than=3600)),
                 [1, 2, 3, 4], None, keep=1, final=[4]),
        Scenario("world2", world2_setup, lambda r: save_world(r, 2, 2), [1], 2, world=2),
        Scenario("async", lambda r: _save(r, [1, 2]), async_action, [1, 2], 3),
    ]


NO_EXCHANGE = "SLURMRESUME_TEST_NO_RENAME_EXCHANGE"  # fsio.exchange then says "unsupported"


def _final_state(step: int) -> dict[str, Any]:
    """What a replace scenario's final save of `step` holds: other weights, other plain values."""
    from helpers.core import tiny_model

    return {"model": tiny_model(50_000 + step), "step": step, "extra": {"tag": f"final{step}", "ints": (1, 2, step)}}


def _replace_scenarios() -> list[Scenario]:
    """Kept out of `_scenarios` (which the ioerror campaign shares)."""
    from slurmresume import Checkpointer

    def replace(root: Path) -> None:
        ck = Checkpointer(root, handle_signals=False)
        if ck.save(2, _final_state(2)) is None:
            raise AssertionError("the final save of step 2 did not replace it")
        ck.close()

    return [Scenario(name, lambda r: _save(r, [1, 2]), replace, [1, 2], 2, replaced=True, exchange=exchange,
                     from_label="unlink.inprogress")
            for name, exchange in (("replace", True), ("replace-nox", False))]


@contextlib.contextmanager
def exchange_mode(available: bool) -> Iterator[None]:
    """Forked children (which re-read fsio when they arm the seam) see RENAME_EXCHANGE as
    `available` or not; the parent's own fsio is left as it is."""
    if available:
        yield
        return
    os.environ[NO_EXCHANGE] = "1"
    try:
        yield
    finally:
        os.environ.pop(NO_EXCHANGE, None)


def _which_copy(state: dict[str, Any], step: int, replaced: bool) -> str | None:
    """"old" (tiny_state) or "new" (_final_state, replace scenarios only) when `state` is exactly
    that copy of `step`, else None."""
    from helpers.core import model_equal, tiny_state

    copies = [("old", tiny_state(step))] + ([("new", _final_state(step))] if replaced else [])
    for name, want in copies:
        if model_equal(state["model"], want["model"]) and state["step"] == step and state["extra"] == want["extra"]:
            return name
    return None


def _data_ok(root: Path, step: int, world: int, verify: bool = False, replaced: bool = False) -> str | None:
    """None when restoring `step` gives exactly tiny_state(step) (or, `replaced`, exactly
    _final_state(step)); else what differs."""
    import torch
    from helpers.core import restore_fresh, tiny_state

    if world == 1:
        got, state = restore_fresh(root, verify=verify)
        if got != step:
            return f"restore returned step {got}, expected {step}"
        if _which_copy(state, step, replaced) is None:
            return (f"restored step {step} is neither copy of it (partial or mixed load): "
                    f"{state['step']!r} {state['extra']!r}")
        return None
    from slurmresume.checkpoint import layout
    from slurmresume.checkpoint.shardread import load_tensors
    from slurmresume.checkpoint.state import flatten
    from slurmresume.checkpoint.store import find_latest

    info = find_latest(root, verify=verify, warn=False)
    if info is None or info.step != step:
        return f"newest complete is {info and info.step}, expected {step}"
    want = dict(flatten(tiny_state(step), {})[1])
    assert info.manifest is not None  # a complete checkpoint has its manifest
    for s in info.manifest.shards:
        tensors, _, _ = load_tensors(info.path, s["file"], s["bytes"])
        for name, t in want.items():
            if not torch.equal(tensors[name], t):
                return f"rank {s['rank']} tensor {name} of step {step} differs (partial load)"
    del layout
    return None


def stranded_copies(root: Path) -> list[str]:
    """Second copies of a step that nothing would ever remove: a parked `.replaced.*`, or a
    committed `.saving.*` without the note by which the leftovers rule judges its writer."""
    from slurmresume.checkpoint.layout import INPROGRESS, MARKER, REPLACED_PREFIX, SAVING_PREFIX

    return sorted(p.name for p in root.iterdir() if p.name.startswith(REPLACED_PREFIX) or (
        p.name.startswith(SAVING_PREFIX) and (p / MARKER).exists() and not (p / INPROGRESS).exists()))


def next_run_starts(root: Path) -> None:
    """What the next run does before its restore: open a Checkpointer on the root (its owner
    settles an interrupted replace), here closed again."""
    from slurmresume import Checkpointer

    Checkpointer(root, handle_signals=False).close()


def _check_after_kill(report: Report, trial: str, root: Path, sc: Scenario) -> None:
    from slurmresume.checkpoint.layout import INPROGRESS, step_dir_name
    from slurmresume.checkpoint.store import list_checkpoints
    from slurmresume.retention import RetentionPolicy, execute, leftovers, record_from_info

    if sc.replaced:  # its guarantee is about what the next run finds
        next_run_starts(root)
    done = check_survivors(report, trial, root, sc.committed, sc.keep)
    newest = max(done) if done else None
    allowed = {max(sc.committed)} | ({sc.new} if sc.new else set())
    if not report.check(newest in allowed, trial, f"newest complete is {newest}, expected one of {sorted(allowed)}"):
        return
    # dead writers are seen as dead: status shows "incomplete", not "being written" forever
    for info in list_checkpoints(root):
        if not info.complete and (info.path / INPROGRESS).exists() and record_from_info(info).in_progress:
            report.fail(trial, f"{info.path.name}: the killed writer is still taken as running")
    for verify in (False, True):
        bad = _data_ok(root, newest, sc.world, verify, sc.replaced)  # type: ignore[arg-type]
        if bad:
            report.count_stat("partial_loads")
        report.check(bad is None, trial, f"verify={verify}: {bad}")
    if sc.replaced:
        from helpers.core import restore_fresh

        report.count_stat(f"{sc.name}_kills")
        report.count_stat(f"{sc.name}_resumed_{_which_copy(restore_fresh(root)[1], 2, True)}_copy")
        stranded = stranded_copies(root)
        if stranded:
            report.count_stat("stranded_copies", len(stranded))
        report.check(not stranded, trial, f"second copies left behind for good: {stranded}")
    else:
        report.count_stat("restored_new" if newest == sc.new else "restored_previous")
    # the next save (or prune) succeeds
    try:
        if sc.new is None:
            execute(root, RetentionPolicy(keep=sc.keep or 1, remove_incomplete_older_than=3600))
            report.check(complete_steps(root) == sc.final, trial,
                         f"after the next prune: {complete_steps(root)}, expected {sc.final}")
            report.check(not leftovers(root), trial, f"next prune left {leftovers(root)}")
            return
        if sc.world == 1:
            from slurmresume.retention import RetentionPolicy as RP

            _save(root, [sc.new], **({"retention": RP(keep=sc.keep)} if sc.keep else {}))
        elif newest != sc.new:
            save_world(root, sc.new, sc.world)
    except Exception as exc:  # noqa: BLE001
        report.fail(trial, f"the next save failed: {type(exc).__name__}: {exc}")
        return
    bad = _data_ok(root, sc.new, sc.world, verify=True)
    report.check(bad is None, trial, f"after the next save: {bad}")
    tmp = temp_leftovers(root / step_dir_name(sc.new))
    report.check(not tmp, trial, f"temp files left in the re-saved step: {tmp}")
    report.check(not half_checkpoints(root), trial, "a half checkpoint after the next save")


def _heartbeat_crossing(spec: str) -> bool:
    """A later crossing of the lease file's labels (`write.owner:2`, ...): the first is the
    acquire, later ones are the heartbeat thread's refreshes (every 0.1 s here), which a traced
    run crosses only when it outlasts an interval, so a kill there is not reproducible (the
    killed child may finish first). Random kills (part B) still land in heartbeats."""
    label, _, n = spec.rpartition(":")
    return label.endswith(".owner") and n.isdigit() and int(n) >= 2


def boundary_matrix(report: Report, work: Path) -> None:
    for sc in _scenarios() + _replace_scenarios():
        with exchange_mode(sc.exchange):
            _boundary_scenario(report, work, sc)


def _boundary_scenario(report: Report, work: Path, sc: Scenario) -> None:
    template = work / f"tpl-{sc.name}"
    sc.setup(template)
    assert complete_steps(template) == sc.committed, (sc.name, complete_steps(template))

    probe = work / f"trace-{sc.name}"
    shutil.copytree(template, probe, symlinks=True)

    def traced(sc: Scenario = sc, probe: Path = probe) -> None:
        _install_dying_rmtree()
        sc.action(probe)

    trace = trace_of(traced, work / f"trace-{sc.name}.txt")
    report.stats.setdefault("labels", {})[sc.name] = len(trace)
    for i in range(trace.index(sc.from_label) if sc.from_label else 0, len(trace)):
        spec = seam_spec(trace, i)
        if _heartbeat_crossing(spec):  # the lease's heartbeat thread: whether a run crosses it is timing
            report.count_stat("heartbeat_labels_skipped")
            continue
        trial = f"{sc.name}@{i}:{spec}"
        root = work / f"kill-{sc.name}-{i}"
        shutil.copytree(template, root, symlinks=True)

        def act(root: Path = root, sc: Scenario = sc) -> None:
            _install_dying_rmtree()
            sc.action(root)

        code, sig = fork_call(act, env={"SLURMRESUME_TEST_KILL_AT": spec}, out=work / "child.out")
        age_lease(root)  # the next run comes later than its fresh heartbeat (harness.age_lease)
        report.trials += 1
        report.count_stat("boundary_kills")
        if sig != signal.SIGKILL:
            report.fail(trial, f"child was not killed (exit {code}): {tail(work / 'child.out')}")
            continue
        _check_after_kill(report, trial, root, sc)
        shutil.rmtree(root, ignore_errors=True)


# -- part B: random kills of a training process -------------------------------------------------

K_STEPS = 8  # the random delay before the kill spans about this many steps
UNTIL = 200  # a child trains this many steps at most (it is killed long before)
RESET_AT = 60  # start a fresh root past this step
# final-nox: the replace without RENAME_EXCHANGE (with it, the boundary matrix's `replace` covers it)
VARIANTS = ("sync", "async", "emergency", "retention", "final-nox")


def _net() -> Any:
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 8))


def _train_step(model: Any, opt: Any, step: int) -> None:
    import torch

    g = torch.Generator().manual_seed(10_000 + step)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 8, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()


def _fresh_state() -> dict[str, Any]:
    import torch

    model = _net()
    return {"model": model, "opt": torch.optim.Adam(model.parameters(), lr=1e-2), "progress": {"step": 0}}


def _snapshot(state: dict[str, Any]) -> Any:
    import copy

    return (copy.deepcopy(state["model"].state_dict()), copy.deepcopy(state["opt"].state_dict()),
            dict(state["progress"]))


def _same(a: Any, b: Any) -> bool:
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _variant_env(variant: str) -> dict[str, str] | None:
    return {NO_EXCHANGE: "1"} if variant.endswith("-nox") else None


def _reference(max_step: int) -> list[Any]:
    state = _fresh_state()
    ref = [_snapshot(state)]
    for s in range(1, max_step + 1):
        _train_step(state["model"], state["opt"], s)
        state["progress"] = {"step": s}
        ref.append(_snapshot(state))
    return ref


def _train_child(root: Path, variant: str, ready_fd: int, until: int) -> None:
    from slurmresume import Checkpointer, RetentionPolicy
    kw: dict[str, Any] = {"save_every": 1}
    if variant == "async":
        kw["async_save"] = True
    if variant == "emergency":
        kw["save_every"] = 3
    if variant == "retention":
        kw["retention"] = RetentionPolicy(keep=2)
    ck = Checkpointer(root, handle_signals=variant == "emergency", exit_on_signal=True, **kw)
    state = _fresh_state()
    step = ck.restore(state)
    os.write(ready_fd, b"r")
    while step < until:
        _train_step(state["model"], state["opt"], step + 1)
        step += 1
        state["progress"] = {"step": step}
        ck.step(step, state)
        if variant.startswith("final"):  # a final evaluation changed the state: the save replaces the step
            state["progress"] = {"step": step, "final": True}
            ck.save(step, state)
    ck.close()


def _restore_matches(root: Path, ref: list[Any], verify: bool) -> tuple[int, str | None]:
    from slurmresume import Checkpointer
    state = _fresh_state()
    with Checkpointer(root, handle_signals=False) as ck:  # closing frees the root for the next child
        step = ck.restore(state, verify=verify)
    if step >= len(ref):
        return step, f"restored step {step} is past the reference"
    model, opt, progress = _snapshot(state)
    if progress.pop("final", True) is not True:  # the final variants' replacing copy says final=True
        return step, f"restored step {step} has a bad final flag {state['progress']!r}"
    if not _same((model, opt, progress), ref[step]):
        return step, f"restored step {step} differs from what was saved (partial load)"
    return step, None


def random_kills(report: Report, work: Path, seed: int, count: int) -> None:
    from slurmresume import Checkpointer, RetentionPolicy
    from slurmresume.checkpoint.layout import saving_dirs, step_dir_name
    from slurmresume.checkpoint.store import list_checkpoints
    from slurmresume.events import read_events

    rng = random.Random(seed)
    ref = _reference(RESET_AT + UNTIL + 2)
    # calibrate: how long does an unkilled child of each variant take for K_STEPS steps?
    spans: dict[str, float] = {}
    for variant in VARIANTS:
        cal = work / f"calibrate-{variant}"
        r, w = os.pipe()
        ready_at: list[float] = []

        def timer(pid: int, r: int = r, ready_at: list[float] = ready_at) -> None:
            select.select([r], [], [], 30)
            os.read(r, 1)
            ready_at.append(time.perf_counter())

        def calibrate(cal: Path = cal, variant: str = variant, w: int = w) -> None:
            _train_child(cal, variant, w, K_STEPS)

        fork_call(calibrate, on_started=timer, env=_variant_env(variant))
        spans[variant] = time.perf_counter() - ready_at[0]  # from "restored" to the end
        os.close(r)
        os.close(w)
        shutil.rmtree(cal, ignore_errors=True)
    report.stats["child_run_seconds"] = {k: round(v, 3) for k, v in spans.items()}
    root_no, root = 0, work / "train-0"
    for trial_no in range(count):
        if root.exists() and (max(complete_steps(root), default=0) > RESET_AT):
            shutil.rmtree(root, ignore_errors=True)
            root_no += 1
            root = work / f"train-{root_no}"
        variant = rng.choice(VARIANTS)
        span = spans[variant]
        delay = rng.uniform(0.0, span)
        delay2 = rng.uniform(0.0, spans["sync"] / K_STEPS * 1.5)  # about one save
        before = set(complete_steps(root)) if root.exists() else set()
        n_events = len(read_events(root)) if root.exists() else 0
        start = max(before, default=0)
        trial = f"random#{trial_no}(seed {seed}, {variant}, from step {start}, kill after {delay * 1000:.0f} ms)"
        r, w = os.pipe()

        def killer(pid: int, r: int = r, delay: float = delay, delay2: float = delay2, variant: str = variant) -> None:
            ready, _, _ = select.select([r], [], [], 30)
            if ready:
                os.read(r, 1)
            time.sleep(delay)
            try:
                if variant == "emergency":
                    os.kill(pid, signal.SIGUSR1)
                    time.sleep(delay2)
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        def train(root: Path = root, variant: str = variant, w: int = w, start: int = start) -> None:
            _train_child(root, variant, w, start + UNTIL)

        code, sig = fork_call(train, on_started=killer, out=work / "train-child.out", env=_variant_env(variant))
        age_lease(root)
        os.close(r)
        os.close(w)
        report.trials += 1
        report.count_stat(f"variant_{variant}")
        if sig == signal.SIGKILL:
            report.count_stat("random_kills")
        elif code in (0, 75):
            report.count_stat(f"{'finished' if code == 0 else 'emergency_exit'}_before_kill_{variant}")
        else:
            report.fail(trial, f"training child ended with exit {code} / signal {sig}: "
                               f"{(work / 'train-child.out').read_text()[-800:]}")
            continue
        events = read_events(root)[n_events:]
        committed = before | {int(e["step"]) for e in events if e.get("event") == "save_committed"}
        partial = [i.path.name for i in list_checkpoints(root) if not i.complete] + [
            p.name for _, p in saving_dirs(root)]  # a killed save leaves its private .saving.* directory
        if partial:
            report.count_stat("kill_left_partial_dir")
        if variant.startswith("final"):  # a replace's guarantee is about what the next run finds
            if any(p.name.startswith(".replaced.") for p in root.iterdir()):
                report.count_stat("kill_between_the_two_renames")  # step_N absent until the next start
            next_run_starts(root)
            if any(p.name.startswith(".replaced.") for p in root.iterdir()):
                report.fail(trial, "the next run's start left a parked copy")
        half = half_checkpoints(root)
        report.check(not half, trial, f"marked but not whole: {half}")
        done = set(complete_steps(root))
        universe = committed | done
        must = set(sorted(universe)[-2:]) if variant == "retention" else committed
        lost = sorted(must - done)
        if lost:
            report.count_stat("lost_committed", len(lost))
        report.check(not lost, trial, f"committed step(s) {lost} lost; complete now {sorted(done)}")
        newest = max(done, default=0)
        report.check(newest >= max(committed, default=0), trial, f"newest complete {newest} < a committed step")
        report.check(newest <= start + UNTIL, trial, f"newest complete {newest} was never trained to")
        try:
            for verify in (False, True):
                got, bad = _restore_matches(root, ref, verify)
                if bad:
                    report.count_stat("partial_loads")
                report.check(bad is None, trial, f"verify={verify}: {bad}")
                if got != newest:
                    report.count_stat("wrong_resumes")
                report.check(got == newest, trial, f"verify={verify}: restored {got}, newest complete is {newest}")
            # the next save succeeds: one more step from the restored state
            state = _fresh_state()
            ck = Checkpointer(root, handle_signals=False,
                              retention=RetentionPolicy(keep=2) if variant == "retention" else None)
            got = ck.restore(state)
            _train_step(state["model"], state["opt"], got + 1)
            state["progress"] = {"step": got + 1}
            ck.save(got + 1, state)
            ck.close()
            again, bad = _restore_matches(root, ref, True)
            report.check(again == got + 1 and bad is None, trial,
                         f"after the next save of step {got + 1}: restored {again}, {bad}")
            tmp = temp_leftovers(root / step_dir_name(got + 1))
            report.check(not tmp, trial, f"temp files in the re-saved step: {tmp}")
            if variant.startswith("final"):
                next_run_starts(root)  # settles second copies whose step is complete now
                stranded = stranded_copies(root)
                if stranded:
                    report.count_stat("stranded_copies", len(stranded))
                report.check(not stranded, trial, f"second copies left behind for good: {stranded}")
        except Exception as exc:  # noqa: BLE001
            report.fail(trial, f"restore / next save raised {type(exc).__name__}: {exc}")


def run(report: Report, work: Path) -> None:
    import torch

    torch.set_num_threads(1)  # forked children must not inherit a thread pool
    # Every trial resumes the root its killed predecessor held: the lease's fresh-heartbeat rule
    # (#27) waits out up to 3 intervals (and 0.2 s) before taking it over, 90 s at the default
    # 30 s interval. The public knob shortens the interval to its floor (0.1 s), as the campaigns
    # shorten every other budget: that wait was 70% of this campaign's time at 0.2 s.
    os.environ.setdefault(ENV_LEASE_HEARTBEAT, "0.1")
    boundary_matrix(report, work)
    random_kills(report, work, report.seed, report.count)
    report.stats.setdefault("partial_loads", 0)
    report.stats.setdefault("lost_committed", 0)
    report.stats.setdefault("wrong_resumes", 0)
    report.stats.setdefault("stranded_copies", 0)


"""Issue 49 (one node): in-memory snapshots on the node, restored first inside the allocation.

The memory tier is a checkpoint root on node-local tmpfs in the file tier's format
(train/memtier.py), made and freed by the node launcher (job/memroot.py); an in-allocation
restart restores from it when it holds a step at least as new as the file tier's, verified like
any restore, and a damaged one costs one fallback to the file tier, named (train/memrestore.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.procs import EXAMPLE, HELPERS, clean_env, rank_pid, signal_tree

from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.train.memplan import MEASURE_STEPS, Schedule, auto_interval, refusal
from slurmresume.train.memrestore import memory_choice

# -- the pure parts: tables --------------------------------------------------------------------------


@pytest.mark.parametrize(("mem", "problem", "mem_world", "file", "asked", "expect"), [
    (7, None, 2, 5, None, 7),  # newer in memory: memory
    (7, None, 2, 7, None, 7),  # as new (a failure save of the same boundary): memory, the faster
    (7, None, 2, 9, None, None),  # the file tier is newer (an emergency save since)
    (None, None, None, 5, None, None),  # nothing in memory
    (7, None, 4, 5, None, None),  # another world size: the file tier reshards
    (7, "manifest digest mismatch", 2, 5, None, None),  # damaged: the fallback
    (7, None, 2, 5, 5, None),  # an explicit step: the file tier
])
def test_memory_choice(mem: int | None, problem: str | None, mem_world: int | None, file: int | None,
                       asked: int | None, expect: int | None) -> None:
    step, why = memory_choice(mem, problem, mem_world, file, 2, asked)
    assert step == expect, why
    assert why.startswith("unusable") == (problem is not None), why


@pytest.mark.parametrize(("cost", "step", "expect"), [(0.0, 0.1, 1), (0.002, 0.1, 1), (0.003, 0.1, 2),
                                                      (0.5, 0.034, 736), (1.0, 0.0, 1)])
def test_auto_interval_keeps_the_cost_under_two_percent(cost: float, step: float, expect: int) -> None:
    n = auto_interval(cost, step)
    assert n == expect
    if cost and step:
        assert cost / (n * step) <= 0.02 + 1e-12


def test_refusal_leaves_headroom_and_obeys_the_limit() -> None:
    gib = 1 << 30
    assert refusal(gib, 8 * gib, 8 * gib, 16 * gib, None) is None
    assert "tmpfs" in (refusal(gib, gib, 8 * gib, 16 * gib, None) or "")  # no headroom left on the tmpfs
    assert "MemAvailable" in (refusal(gib, 8 * gib, gib + (100 << 20), 16 * gib, None) or "")
    assert "SLURMRESUME_MEMORY_LIMIT_BYTES" in (refusal(gib, 8 * gib, 8 * gib, 16 * gib, gib - 1) or "")
    assert refusal(gib, 8 * gib, 3 * gib, 16 * gib, None) is None
    assert "buffers included" in (refusal(gib, 8 * gib, 3 * gib, 16 * gib, None, buffers=2 * gib) or "")


def test_schedule_is_step_numbers_and_calls_only() -> None:
    every = Schedule(3)
    assert [s for s in range(1, 10) if every.due(s)] == [3, 6, 9]
    auto = Schedule(None)
    due = [s for s in range(1, 30) if auto.due(s) and (auto.taken(0 if s == MEASURE_STEPS else 4) or True)]
    assert due == [MEASURE_STEPS, 2 * MEASURE_STEPS, 2 * MEASURE_STEPS + 4, 2 * MEASURE_STEPS + 8,
                   2 * MEASURE_STEPS + 12, 2 * MEASURE_STEPS + 16]


# -- in one process: the restore order, the fallback ------------------------------------------------


def _state(seed: int) -> dict:
    import torch

    torch.manual_seed(seed)
    return {"w": torch.randn(64, 64), "b": torch.randn(64), "n": seed}


def _save(root: Path, step: int, state: dict) -> None:
    from slurmresume.checkpoint.collective import Group
    from slurmresume.train.saving import payload_of, save_collective

    result = save_collective(Group(), root, step, payload_of(step, state, None, None), replace_if_changed=False)
    assert result.outcome is not None and result.outcome.ok


def _restore(root: Path, memory: Path, state: dict) -> tuple[int, list[dict]]:
    from slurmresume.checkpoint.collective import Group
    from slurmresume.train.restoreload import Request
    from slurmresume.train.restoring import restore_and_record

    info = restore_and_record(Group(), root, state, Request.of(None, False, True, True, None), None,
                              created_at=time.time(), memory=memory)
    assert info is not None
    return info.step, _events(root)


def test_restore_reads_memory_first_and_a_flipped_byte_falls_back_once(tmp_path: Path) -> None:
    import torch

    root, memory = tmp_path / "root", tmp_path / "shm"
    _save(root, 5, _state(5))
    _save(memory, 7, _state(7))
    state = _state(0)
    step, ev = _restore(root, memory, state)
    assert step == 7 and torch.equal(state["w"], _state(7)["w"]) and state["n"] == 7
    (r,) = [e for e in ev if e["event"] == "restored"]
    assert (r["tier"], r["step"], r["memory_fallback"]) == ("memory", 7, None) and r["restore_s"] >= 0

    shard = memory / step_dir_name(7) / "rank-00000-of-00001.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0x01  # one bit of the tensor data
    shard.write_bytes(bytes(raw))
    from slurmresume.checkpoint.collective import Group
    from slurmresume.train.restoreload import Request
    from slurmresume.train.restoring import restore_and_record

    # all or nothing: with nothing in the file tier the run starts fresh, its state as it was, bit for bit
    state = _state(0)
    got = restore_and_record(Group(), tmp_path / "empty", state, Request.of(None, False, True, True, None), None,
                             created_at=time.time(), memory=memory)
    assert got is None and all(torch.equal(state[k], _state(0)[k]) for k in ("w", "b")) and state["n"] == 0
    _save(memory, 7, _state(7))
    shard.write_bytes(bytes(raw))  # damaged again, for the file tier's root
    before = state["w"].clone()
    step, ev = _restore(root, memory, state)
    assert step == 5 and torch.equal(state["w"], _state(5)["w"]) and not torch.equal(state["w"], before)
    fallbacks = [e for e in ev if e["event"] == "memory_fallback"]
    assert len(fallbacks) == 1 and fallbacks[0]["step"] == 7, fallbacks
    r = [e for e in ev if e["event"] == "restored"][-1]
    assert r["tier"] == "file" and "step 7" in r["memory_fallback"], r
    assert not (memory / step_dir_name(7)).exists()  # never tried again: no loop over restarts
    step, ev = _restore(root, memory, _state(0))
    assert step == 5 and len([e for e in ev if e["event"] == "memory_fallback"]) == 1


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A memory root on tmpfs, as the launcher makes it (its restores read in two passes, the
    pages being memory); tmp_path where there is no /dev/shm."""
    import shutil
    import tempfile

    base = Path("/dev/shm")
    path = Path(tempfile.mkdtemp(prefix="test-memtier-", dir=base)) / "shm" if base.is_dir() else tmp_path / "shm"
    yield path
    if base.is_dir():
        shutil.rmtree(path.parent, ignore_errors=True)


def _big_state(seed: int) -> dict:
    import torch

    torch.manual_seed(seed)  # "w": 5 MiB, two VERIFY_BLOCK blocks, the second a short one
    return {"w": torch.randn(5 << 18), "b": torch.randn(64), "n": seed}


def test_the_memory_tier_is_read_through_mappings_the_file_tier_is_not(tmp_path: Path, shm: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Both passes of a memory-tier restore read the shard's pages through one mapping per
    tensor (checkpoint/mapped.py: hashed where they lie, then copied once), bit for bit; a file
    restore still reads with pread (a shared file system's file may shrink under a mapping)."""
    import torch

    from slurmresume.checkpoint import mapped

    views: list[int] = []
    real = mapped.Mappings.view

    def counted(self: mapped.Mappings, fd: int, offset: int, length: int, path: object) -> memoryview | None:
        got = real(self, fd, offset, length, path)
        views.append(len(got) if got is not None else 0)
        return got

    monkeypatch.setattr(mapped.Mappings, "view", counted)
    root, memory = tmp_path / "root", shm
    _save(root, 5, _big_state(5))
    _save(memory, 7, _big_state(7))
    state = _big_state(0)
    assert _restore(root, memory, state)[0] == 7
    assert all(torch.equal(state[k], _big_state(7)[k]) for k in ("w", "b")) and state["n"] == 7
    assert views.count(state["w"].nbytes) == views.count(state["b"].nbytes) == 2, views  # both passes, each byte
    views.clear()
    state = _big_state(0)
    assert _restore(root, tmp_path / "none", state)[0] == 5 and torch.equal(state["w"], _big_state(5)["w"])
    assert views == []


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="two passes need the memory root on tmpfs")
def test_a_memory_shard_changed_between_the_passes_is_caught_and_the_file_tier_restores(
        tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second pass copies through the mapping the first pass verified and hashes each block
    where it landed: a byte changed in place after the verdict (the same inode: the mapping sees
    it) is refused there, and the one named fallback restores the file tier's step whole."""
    import torch

    from slurmresume.train import restoreplan

    root, memory = tmp_path / "root", shm
    _save(root, 5, _big_state(5))
    _save(memory, 7, _big_state(7))
    shard = memory / step_dir_name(7) / "rank-00000-of-00001.safetensors"
    real = restoreplan.verify_tensors

    def then_flip(*args: object, **kwargs: object) -> int:
        done = real(*args, **kwargs)  # type: ignore[arg-type]
        with open(shard, "r+b") as f:  # in place, after this rank verified it
            f.seek(-5, 2)
            byte = f.read(1)[0]
            f.seek(-5, 2)
            f.write(bytes([byte ^ 0x01]))
        flipped[0] += 1
        return done

    monkeypatch.setattr(restoreplan, "verify_tensors", then_flip)
    flipped = [0]
    state = _big_state(0)
    step, ev = _restore(root, memory, state)
    assert step == 5 and all(torch.equal(state[k], _big_state(5)[k]) for k in ("w", "b")) and state["n"] == 5
    (fallback,) = [e for e in ev if e["event"] == "memory_fallback"]
    assert fallback["step"] == 7 and "while it read into the live state" in fallback["reason"], fallback
    assert flipped == [1]


def test_mappings_refuse_a_range_past_the_end_and_unmap_on_close(tmp_path: Path) -> None:
    import os

    from slurmresume.checkpoint.mapped import Mappings
    from slurmresume.errors import CorruptCheckpointError

    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 64)
    fd = os.open(path, os.O_RDONLY)
    try:
        maps = Mappings()
        view = maps.view(fd, 5000, 100, path)
        assert view is not None and bytes(view) == path.read_bytes()[5000:5100]
        assert maps.view(fd, 5000, 100, path) is view  # the second pass reuses the first's mapping
        assert maps.view(fd, 0, 0, path) is None
        with pytest.raises(CorruptCheckpointError, match="past its end"):
            maps.view(fd, 16000, 1000, path)
        maps.close()
        with pytest.raises(ValueError):
            bytes(view)  # released: the mapping is gone
    finally:
        os.close(fd)


# -- end to end: submit --local, 2 ranks, one SIGKILL --------------------------------------------

ARGS = ["--steps", "24", "--save-every", "10", "--step-sleep", "0.05"]


def _events(root: Path) -> list[dict]:
    path = root / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _submit(root: Path, script: Path, shm: Path, *options: str, **env: str) -> subprocess.Popen[str]:
    shm.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "slurmresume", "submit", str(script), "--ckpt-dir", str(root),
                             "--local", "--nproc-per-node", "2", *options, "--", *ARGS],
                            env=clean_env(SLURMRESUME_MEMORY_BASE=str(shm), **env), cwd=root.parent,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _finish(proc: subprocess.Popen[str]) -> str:
    try:
        out, _ = proc.communicate(timeout=900)  # a hang guard only
    except subprocess.TimeoutExpired:
        signal_tree(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 0, out[-5000:]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, Path]:
    """An uninterrupted run with the default `--snapshot-every auto`: its last step is what every
    interrupted run must end with, bitwise, and its output shows the interval auto chose."""
    base = tmp_path_factory.mktemp("reference")
    root, shm = base / "root", base / "shm"
    out = _finish(_submit(root, EXAMPLE, shm))
    return root, out, shm


@pytest.mark.slow
def test_auto_chooses_and_prints_the_interval_once_and_the_job_frees_its_memory(
        reference: tuple[Path, str, Path]) -> None:
    root, out, shm = reference
    assert out.count("memory tier: a snapshot every ") == 1, out[-3000:]
    assert "(auto: the measured cost kept under 2% of the step time)" in out
    assert (root / step_dir_name(24) / "COMMITTED").exists()
    assert list(shm.iterdir()) == []  # the launcher freed the node's memory root at the end


@pytest.mark.slow
def test_a_snapshot_that_does_not_fit_is_one_warning_and_training_goes_on(tmp_path: Path) -> None:
    """A node that cannot hold a snapshot (here: a limit of 1000 bytes): one warning, one event, the
    tier off, and training goes on with the file tier to its end."""
    root = tmp_path / "root"
    out = _finish(_submit(root, EXAMPLE, tmp_path / "shm", "--snapshot-every", "1",
                          SLURMRESUME_MEMORY_LIMIT_BYTES="1000"))
    assert out.count("memory tier off for this run") == 1, out[-3000:]
    refused = [e for e in _events(root) if e["event"] == "memory_refused"]
    assert len(refused) == 1 and "SLURMRESUME_MEMORY_LIMIT_BYTES" in refused[0]["reason"], refused
    assert (root / step_dir_name(24) / "COMMITTED").exists()


def _killed_run(tmp_path: Path, flip: bool) -> tuple[Path, list[dict], int]:
    """Rank 1 stops itself in the forward of step k + 1 once the memory snapshot of step k is
    committed; the test (optionally flips one byte of that snapshot, then) SIGKILLs its tree."""
    root, shm = tmp_path / "root", tmp_path / "shm"
    kill_step = 13
    proc = _submit(root, HELPERS / "unwarned_train.py", shm, "--snapshot-every", "1",
                   STOP_AFTER_STEP=str(kill_step), STOP_RANK="1", STOP_AFTER_MEMORY="1")
    end = time.monotonic() + 600
    pid = None
    while pid is None or _state_of(pid) != "T":
        assert proc.poll() is None and time.monotonic() < end, "the run ended before its kill"
        time.sleep(0.02)
        pid = pid or rank_pid(proc.pid, 1)
    (memory,) = shm.iterdir()
    snap = memory / step_dir_name(kill_step)
    assert (snap / "COMMITTED").exists()
    if flip:
        shard = snap / "rank-00001-of-00002.safetensors"
        raw = bytearray(shard.read_bytes())
        raw[-3] ^= 0x10
        shard.write_bytes(bytes(raw))
    signal_tree(pid, signal.SIGKILL)
    _finish(proc)
    assert list(shm.iterdir()) == []  # freed when the job ended
    return root, _events(root), kill_step


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "?"


@pytest.mark.slow
def test_a_sigkilled_rank_restarts_from_memory_and_ends_bitwise(tmp_path: Path,
                                                                reference: tuple[Path, str, Path]) -> None:
    from slurmresume.tools.compare import compare_checkpoints

    root, ev, k = _killed_run(tmp_path, flip=False)
    restored = [(e["step"], e.get("tier")) for e in ev if e["event"] == "restored"]
    assert restored == [(k, "memory")], restored
    assert not [e for e in ev if e["event"] == "memory_fallback"]
    assert compare_checkpoints(reference[0] / step_dir_name(24), root / step_dir_name(24)) == []
    from slurmresume.cli.render_status import failure_text
    from slurmresume.tools.status import compute_status

    (f,) = compute_status(root).failures  # what `status` shows: the tier, and how long the restore took
    assert (f["resumed_from"], f["resumed_tier"]) == (k, "memory") and f["restore_s"] is not None, f
    assert f"resumed from step {k} (memory tier, restored in " in failure_text(f), failure_text(f)


@pytest.mark.slow
def test_a_flipped_byte_in_memory_is_one_named_fallback_to_the_file_tier(tmp_path: Path,
                                                                         reference: tuple[Path, str, Path]) -> None:
    from slurmresume.tools.compare import compare_checkpoints

    root, ev, k = _killed_run(tmp_path, flip=True)
    fallbacks = [e for e in ev if e["event"] == "memory_fallback"]
    assert len(fallbacks) == 1 and fallbacks[0]["step"] == k, fallbacks
    (r,) = [e for e in ev if e["event"] == "restored"]
    assert r["tier"] == "file" and f"step {k}" in r["memory_fallback"], r
    assert [e["action"] for e in ev if e["event"] == "run_ended"] == ["retry", "finish"]
    assert compare_checkpoints(reference[0] / step_dir_name(24), root / step_dir_name(24)) == []


# -- the launcher's side: the node's memory root, what `status` shows of it -------------------------


def test_the_memory_root_is_made_private_shown_and_freed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import json as _json
    import os

    from slurmresume.job import memroot
    from slurmresume.job.hbsweep import namespace_and_boot
    from slurmresume.tools.status_sections import rank_view

    monkeypatch.setenv(memroot.ENV_BASE, str(tmp_path))
    here = namespace_and_boot()
    assert here is not None
    gone = tmp_path / f"{memroot.PREFIX}slurm-1.n0-o999999.1.{here[0]}.{here[1]}-x"  # its launcher is gone (no such pid)
    gone.mkdir()
    path = memroot.create("slurm-7", 0)
    assert path is not None and path.parent == tmp_path and path.name.startswith(memroot.PREFIX)
    assert not gone.exists() and oct(path.stat().st_mode & 0o777) == "0o700"
    assert memroot.view(path) == {"step": None, "bytes": 0}
    _save(path, 3, _state(3))
    shown = memroot.view(path)
    assert shown is not None and shown["step"] == 3 and shown["bytes"] > 64 * 64 * 4
    runs = tmp_path / "root" / ".runs"
    runs.mkdir(parents=True)
    (runs / "job.node-0.ranks.json").write_text(_json.dumps({"time": 1.0, "host": "n1", "ranks": {}, "memory": shown}))
    view = rank_view(tmp_path / "root", 2.0)
    assert view is not None and view["memory"] == {"n1": shown}
    memroot.remove(path)
    assert not path.exists()
    monkeypatch.setenv(memroot.ENV_BASE, "none")
    assert memroot.create("slurm-7", 0) is None and os.listdir(tmp_path) == ["root"]


def test_a_file_restore_drops_newer_memory_snapshots_of_another_trajectory(tmp_path: Path) -> None:
    """`--resume-from 5` while memory holds step 7 (of the run before): the run retrains 6, 7 on
    another trajectory, and step 7 in memory must not be restored after a crash there."""
    from slurmresume.checkpoint.collective import Group
    from slurmresume.train.restoreload import Request
    from slurmresume.train.restoring import restore_and_record

    root, memory = tmp_path / "root", tmp_path / "shm"
    _save(root, 5, _state(5))
    _save(memory, 4, _state(4))
    _save(memory, 7, _state(7))
    info = restore_and_record(Group(), root, _state(0), Request.of(5, False, True, True, None), None,
                              created_at=time.time(), memory=memory)
    assert info is not None and info.step == 5
    assert not (memory / step_dir_name(7)).exists() and (memory / step_dir_name(4)).exists()


@pytest.mark.slow
def test_a_refused_failure_save_costs_the_steps_since_the_snapshot_not_since_the_file_save(
        tmp_path: Path, reference: tuple[Path, str, Path]) -> None:
    """Rank 1 dies right after its optimizer step of step k while the others are past theirs: the
    failure save is refused (never mixed steps) and the file tier holds step 10 only; the memory
    tier's snapshot of step k - 1 (or k - 2, were the last one still being written) is restored
    instead of step 10, and the job ends bitwise."""
    from slurmresume.tools.compare import compare_checkpoints
    from slurmresume.train.failsave import FINISH_WAIT_S

    root, shm = tmp_path / "root", tmp_path / "shm"
    k = 16
    _finish(_submit(root, HELPERS / "unwarned_train.py", shm, "--snapshot-every", "1", KILL_AT_STEP=str(k),
                    KILL_RANK="1", SURVIVOR_SLEEP=str(FINISH_WAIT_S + 3)))
    ev = _events(root)
    assert [e["committed"] for e in ev if e["event"] == "failure_save"] == [False]
    (r,) = [e for e in ev if e["event"] == "restored"]
    assert r["tier"] == "memory" and r["step"] in (k - 2, k - 1), r
    assert compare_checkpoints(reference[0] / step_dir_name(24), root / step_dir_name(24)) == []


@pytest.mark.parametrize("bad", ["bogus", "-3", "1.5", True])
def test_a_bad_snapshot_every_is_one_line_before_anything_is_made(tmp_path: Path, bad: object) -> None:
    from slurmresume import Checkpointer
    from slurmresume.errors import ConfigError
    from slurmresume.job.config import JobSpec

    with pytest.raises(ConfigError, match="give 'auto', 'off'"):
        Checkpointer(tmp_path / "root", snapshot_every=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "root").exists()
    if not isinstance(bad, bool):
        with pytest.raises(ConfigError, match="--snapshot-every"):
            JobSpec(script=EXAMPLE, ckpt_dir=tmp_path / "root", snapshot_every=str(bad))

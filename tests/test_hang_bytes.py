"""Issue #26: save, restore and mirror-pull budgets scale with the bytes to move and the measured
throughput. The model as a table (pure), the rank's side of the channel (real heartbeat files),
and whole runs where a save's bytes stop moving for longer than the floor (a long final fsync)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.procs import HELPERS, clean_env, signal_tree

from slurmresume.beatfile import (
    IO_MEASURE_MIN_BYTES,
    RESTORE,
    SAVE,
    Record,
    read_record,
    record_path,
)
from slurmresume.job.hang import HangBudgets, budget, io_seconds, judge
from slurmresume.train.heartbeat import Beat, expect_io, phase

MB = 1_000_000
B = HangBudgets()  # floor 300 s, 5 x longest save, 3 x bytes at 50 MB/s


def rec(ph: str, *, nbytes: int = 0, rate: float = 0.0, save: float = 0.0, t: float = 100.0) -> Record:
    return Record(1, 0, ph, 10, t, t, 0.05, save, 10, (), 0.0, 0.0, nbytes, rate)


@pytest.mark.parametrize(
    ("record", "budgets", "seconds"),
    [
        (rec(SAVE), B, 300.0),  # nothing known: the floor
        (rec(SAVE, nbytes=1000 * MB), B, 300 + 3 * 1000 / 50),  # 1 GB, nothing measured: 50 MB/s assumed
        (rec(SAVE, nbytes=40_000 * MB), B, 300 + 3 * 40_000 / 50),  # a 40 GB first save: 2700 s, not 300
        (rec(SAVE, nbytes=40_000 * MB, rate=2000 * MB), B, 300 + 3 * 40_000 / 2000),  # measured 2 GB/s
        (rec(SAVE, nbytes=1000 * MB, save=100.0), B, 300 + 5 * 100),  # the save history is larger
        (rec(SAVE, nbytes=1000 * MB), HangBudgets(io_rate_mbs=10), 300 + 3 * 1000 / 10),  # --hang-io-rate 10
        (rec(SAVE, nbytes=1000 * MB), HangBudgets(save_floor_s=20), 20 + 3 * 1000 / 50),  # --hang-save 20
        (rec(RESTORE), B, 900.0),  # restore: at least the start-up budget
        (rec(RESTORE, nbytes=20_000 * MB), B, 300 + 3 * 20_000 / 50),  # a 20 GB pull: 1500 s, past start-up
        (rec(RESTORE, nbytes=20_000 * MB, rate=400 * MB), B, 900.0),  # measured fast: start-up wins
    ],
)
def test_the_budget_model(record: Record, budgets: HangBudgets, seconds: float) -> None:
    """save = floor + max(5 x longest save, 3 x bytes / throughput); restore: the same, at least
    the start-up budget; throughput measured, else --hang-io-rate."""
    assert budget(record, budgets)[1] == pytest.approx(seconds)


def test_io_seconds_is_zero_without_bytes_and_scales_linearly() -> None:
    assert io_seconds(0, 0.0, B) == 0.0
    assert io_seconds(100 * MB, 0.0, B) == pytest.approx(6.0)
    assert io_seconds(200 * MB, 0.0, B) == pytest.approx(12.0)
    assert io_seconds(200 * MB, 100 * MB, B) == pytest.approx(6.0)
    assert io_seconds(200 * MB, 100 * MB, replace(B, io_factor=2.0)) == pytest.approx(4.0)


def test_ranks_restoring_on_a_node_share_the_pullers_bytes_term() -> None:
    """Rank 0 pulls 3 GB (180 s at 50 MB/s x 3 + 2 s floor) while rank 1 waits in a collective,
    silent, with no bytes of its own: neither is over budget at 100 s; both are at 200 s."""
    b = HangBudgets(save_floor_s=2.0, startup_s=5.0)
    records = {0: rec(RESTORE, nbytes=3000 * MB, t=0.0), 1: rec(RESTORE, t=0.0)}
    assert judge(records, now=100.0, b=b) is None
    hang = judge(records, now=200.0, b=b)
    assert hang is not None and hang.over == (0, 1) and hang.budget_s == pytest.approx(182.0)


def test_the_rank_publishes_its_bytes_and_measured_rate(tmp_path: Path) -> None:
    """Beat.expect (through expect_io inside a phase) writes the bytes; a transfer of at least
    64 MiB is measured at its end, and the next one of that kind carries the slowest rate seen.
    Outside a phase expect_io is a no-op."""
    beat = Beat(tmp_path, 0)
    expect_io("save", 123)  # no phase: nothing happens
    assert read_record(record_path(tmp_path, 0)).expect_bytes == 0
    with phase(beat, SAVE):
        expect_io("save", IO_MEASURE_MIN_BYTES)
        got = read_record(record_path(tmp_path, 0))
        assert (got.phase, got.expect_bytes, got.rate) == (SAVE, IO_MEASURE_MIN_BYTES, 0.0)
        time.sleep(0.05)
    after = read_record(record_path(tmp_path, 0))
    assert after.expect_bytes == 0 and after.rate == 0.0  # left the save: nothing in progress
    measured = beat.rates["save"]
    assert 0 < measured <= IO_MEASURE_MIN_BYTES / 0.05
    with phase(beat, SAVE):
        expect_io("save", 10)  # too small to be measured, but published with the rate measured before
        assert read_record(record_path(tmp_path, 0)).rate == pytest.approx(measured)
    assert beat.rates["save"] == measured
    with phase(beat, RESTORE):
        expect_io("pull", 5 * MB)  # another kind: nothing measured for it yet
        assert read_record(record_path(tmp_path, 0)).rate == 0.0
    beat.close()


# -- whole runs: a save whose bytes stop moving for longer than the floor ---------------------------

HANG_TRAIN = HELPERS / "hang_train.py"
# --hang-save 2, --hang-io-rate 2 (MB/s): a 4 MiB shard's bytes term is 3 x 4.19 / 2 = 6.3 s
SPEC = "max_hangs=1, hang_io_rate=2, hang_budgets=HangBudgets(startup_s=30, floor_s=2, save_floor_s=2)"


def _run(tmp_path: Path, pause: str, timeout: float = 180.0) -> tuple[int | None, str, list[dict]]:
    """`run_local` (the `submit --local` launcher), 2 ranks of hang_train.py, 25 steps, saves every 10."""
    code = ("import sys, json; from pathlib import Path; from slurmresume.job.config import JobSpec; "
            "from slurmresume.job.hang import HangBudgets; from slurmresume.job.node import run_local; "
            f"spec = JobSpec(script=Path({str(HANG_TRAIN)!r}), script_args=tuple(sys.argv[1:]), "
            f"ckpt_dir=Path({str(tmp_path / 'ckpt')!r}), nproc_per_node=2, {SPEC}); "
            "print(json.dumps(run_local(spec)))")
    env = clean_env(PIDDIR=str(tmp_path / "pids"), PYTHONPATH=os.environ.get("PYTHONPATH", ""), FSYNC_PAUSE=pause)
    proc = subprocess.Popen([sys.executable, "-c", code, "25", "0.05", "-1", "1", "0", "10"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGKILL)
            out = proc.communicate()[0]
    events = [json.loads(x) for x in (tmp_path / "ckpt" / "events.jsonl").read_text().splitlines()]
    return proc.returncode, out, events


@pytest.mark.slow
def test_a_save_silent_in_its_final_fsync_longer_than_the_floor_is_not_a_hang(tmp_path: Path) -> None:
    """Save floor 2 s, nothing measured yet: the first save's bytes are written, then every rank
    sits 5 s in the shard's final fsync with no byte moving. Its budget scales with its 4 MiB
    (2 + 3 x 4.19 MB / 2 MB/s = 8.3 s): 0 kills (the old watch allowed the 2 s floor: killed,
    again after the restart at the same step, then held)."""
    rc, out, ev = _run(tmp_path, "*:5")
    assert [e for e in ev if e["event"] == "hang"] == [] and rc == 0, out[-3000:]
    saves = [e["seconds"] for e in ev if e["event"] == "save_committed"]
    assert saves and saves[0] > 5.0, saves  # the first save really sat past the floor with no bytes moving
    assert any(e["event"] == "finished" and e["step"] == 25 for e in ev), out[-3000:]


@pytest.mark.slow
def test_a_save_stuck_in_its_final_fsync_is_caught_within_its_scaled_budget(tmp_path: Path) -> None:
    """Rank 1's first save never returns from its final fsync: caught in the save phase within
    its scaled budget (8.3 s, not the 2 s floor) + 1 s of its last sign of life; the restarted
    run finishes."""
    rc, out, ev = _run(tmp_path, "1:inf")
    hangs = [e for e in ev if e["event"] == "hang"]
    assert len(hangs) == 1 and 1 in hangs[0]["ranks"] and hangs[0]["phase"] == "save", out[-3000:]
    assert hangs[0]["budget_s"] == pytest.approx(2 + 3 * (4 << 20) / 2e6, abs=0.2), hangs[0]
    assert hangs[0]["detect_latency_s"] <= hangs[0]["budget_s"] + 1.0, hangs[0]
    assert rc == 0 and any(e["event"] == "finished" and e["step"] == 25 for e in ev), out[-3000:]


def test_status_view_shows_the_bytes_in_flight_and_the_scaled_budget(tmp_path: Path) -> None:
    """The launcher's per-node summary (what `status` reads): a rank saving 100 MB shows them and
    its budget now (--hang-save 2: 2 + 3 x 100 / 50 = 8 s); a rank between steps shows no bytes."""
    from slurmresume.job.hangwatch import HangWatch

    saver, stepper = Beat(tmp_path, 0), Beat(tmp_path, 1)
    stepper.beat_step(1)
    watch = HangWatch(tmp_path, HangBudgets(save_floor_s=2.0), procs=2)
    with phase(saver, SAVE):
        expect_io("save", 100 * MB)
        watch.refresh()
        rows = watch.summary(time.monotonic())["ranks"]
    assert (rows["0"]["phase"], rows["0"]["moving_bytes"], rows["0"]["budget_s"]) == (SAVE, 100 * MB, 8.0)
    assert rows["1"]["moving_bytes"] == 0 and rows["1"]["budget_s"] == 900.0  # warm-up: the start-up budget
    assert "3x its bytes at the measured throughput (else 50 MB/s)" in watch.summary(time.monotonic())["budgets"]
    saver.close()
    stepper.close()


def test_a_pull_filling_a_preallocated_shard_is_seen_moving(tmp_path: Path) -> None:
    """A mirror pull sets each shard's full size first (ftruncate) and fills it as parts arrive:
    its size never moves, its allocated blocks do. The watch sees the bytes arrive (the old watch
    summed sizes only: a pull was never 'moving', and a long one was killed at the restore floor)."""
    from slurmresume.checkpoint.leftovers import DOWNLOAD_PREFIX
    from slurmresume.job.hangwatch import HangWatch

    root, hb = tmp_path / "ckpt", tmp_path / "hb"
    pull = root / f"{DOWNLOAD_PREFIX}step_000000005.1.abcdef12"
    pull.mkdir(parents=True)
    hb.mkdir()
    fd = os.open(pull / "rank-00000-of-00001.safetensors", os.O_WRONLY | os.O_CREAT, 0o644)
    os.ftruncate(fd, 8 << 20)
    beat = Beat(hb, 0)
    beat.enter(RESTORE)
    watch = HangWatch(hb, HangBudgets(startup_s=1.0, save_floor_s=1.0), procs=1, root=root)
    t = time.monotonic()
    assert watch.poll(t, [os.getpid()]) is None
    os.pwrite(fd, os.urandom(1 << 20), 0)  # a part arrived; the size is unchanged
    os.fsync(fd)
    assert watch.poll(t + 1.5, [os.getpid()]) is None  # over its 1 s by its heartbeat, alive by its bytes
    hang = watch.poll(t + 2.7, [os.getpid()])  # nothing arrived since t + 1.5
    assert hang is not None and hang.phase == RESTORE and hang.silent_s == pytest.approx(1.2)
    os.close(fd)
    beat.close()


def test_hang_doc_and_submit_help_state_the_budgets_the_code_uses() -> None:
    """docs/hang-detection.md (moved from the README) and `submit --help` name the numbers
    HangBudgets() holds."""
    import re

    from helpers.procs import REPO
    from typer.testing import CliRunner

    from slurmresume.cli import app

    section = (REPO / "docs" / "hang-detection.md").read_text()
    b = HangBudgets()
    for fact in (f"| {b.startup_s:g} s | `--hang-startup`", f"{b.multiple:g} × the longest step seen + {b.floor_s:g} s",
                 f"{b.busy_s:g} s, or `ckpt.busy(", f"{b.save_floor_s:g} s + the larger of {b.save_multiple:g} × the "
                 "longest save", f"{b.io_factor:g} × its bytes ÷ the throughput",
                 f"`--hang-io-rate` (default {b.io_rate_mbs:g} MB/s)", f"{b.warmup_steps} steps of a run"):
        assert fact in section, fact
    out = CliRunner().invoke(app, ["submit", "--help"], env={"COLUMNS": "250", "NO_COLOR": "1", "TERM": "dumb"}).stdout
    flat = re.sub(r"\s*│\s*", " ", out)
    flat = re.sub(r"\s+", " ", flat)
    for option, default in (("--hang-startup", b.startup_s), ("--hang-busy", b.busy_s), ("--hang-save", b.save_floor_s),
                            ("--hang-io-rate", b.io_rate_mbs)):
        block = flat[flat.index(f"{option} "):]
        assert f"[default: {default:g}]" in block[:700], (option, block[:700])
    assert f"{b.multiple:g}x the longest step + {b.floor_s:g} s" in flat
    assert f"{b.io_factor:g}x the time its bytes take" in flat


def test_status_screen_names_a_saving_ranks_bytes_and_budget() -> None:
    """`status`'s rank table: a rank saving shows its bytes in flight and its budget now."""
    from types import SimpleNamespace

    from rich.console import Console

    from slurmresume.cli.render_sections import hang_view

    view = {"budgets": "…", "stragglers": [], "straggler_margin": 0.2, "ranks": {
        "0": {"step": 10, "phase": SAVE, "age_s": 3.0, "moving_bytes": 4_190_000_000, "budget_s": 551.4},
        "1": {"step": 10, "phase": "step", "age_s": 0.1, "moving_bytes": 0, "budget_s": 900.0}}}
    console = Console(width=200, record=True, color_system=None)
    for part in hang_view(SimpleNamespace(ranks=view, last_hang=None)):
        console.print(part)
    text = console.export_text()
    assert "save (4.19 GB, budget 551.4 s)" in text
    assert "step (" not in text


def test_a_pull_takes_the_slowest_logged_pull_rate_when_this_process_measured_none(tmp_path: Path) -> None:
    """Rank 0's pull publishes the slowest of the log's recent pulls of >= 64 MiB (a requeued
    job on the same slow link gets the budget its last pull needed), never a small one's."""
    from slurmresume.events import logged_pull_rate

    big = IO_MEASURE_MIN_BYTES
    events = [{"event": "mirror_downloaded", "bytes": big, "seconds": 4.0},
              {"event": "mirror_downloaded", "bytes": 2 * big, "seconds": 4.0},
              {"event": "mirror_downloaded", "bytes": 1000, "seconds": 10.0},  # too small to be a rate
              {"event": "save_committed", "bytes": big, "seconds": 100.0}]
    assert logged_pull_rate(events) == pytest.approx(big / 4.0)
    assert logged_pull_rate([]) == 0.0
    beat = Beat(tmp_path, 0)
    with phase(beat, RESTORE):
        expect_io("pull", 8 * big, logged_pull_rate(events))
        got = read_record(record_path(tmp_path, 0))
    assert (got.expect_bytes, got.rate) == (8 * big, pytest.approx(big / 4.0))
    assert budget(got, replace(B, startup_s=10))[1] == pytest.approx(300 + 3 * 8 * 4.0)  # 3 x 32 s at the logged rate
    beat.close()

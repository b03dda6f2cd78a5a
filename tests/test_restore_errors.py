"""First, do no harm in the restore: whatever one rank's plan or read raises ends the restore the
same way on every rank (issue #29's "seen and left": a ConfigError that one rank alone raised
while planning left the others to die inside gloo, with a traceback that named nothing).

Three (or four) ranks forked from the test process over gloo, each restoring as a training script
would: an exception leaves the rank at once with exit code 1 (no barrier, no close), so a peer
left in a collective would hang or crash in gloo. Each rank records the exception it raised, its
log and its stderr; the parent kills what is still alive after a deadline.

  what one rank raises                         every rank raises                  fallback
  ConfigError (plan: its state does not fit)   ConfigError "rank N: ..."          none
  an unexpected exception (plan, read, pass 2) RankFailedError "rank N ... Type"  none
  OSError (read)                               nothing: the older step loads      as before
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from slurmresume import Checkpointer, ConfigError
from slurmresume.contract import ENV_RESTORE_STAGING
from slurmresume.errors import CorruptCheckpointError
from slurmresume.train import restorechoice, restoreload, restoreplan, restoreverdict

WORLD = 3
DEADLINE_S = 40.0  # a whole round of forked ranks; a rank left in a collective is still there then


@dataclass(frozen=True)
class Rank:
    """How one forked rank ended."""

    exitcode: int | None  # None: killed at the deadline (it hung)
    error: str | None  # "Type: message" of what its body raised
    result: Any
    log: str  # its "slurmresume" log
    stderr: str


def run_ranks(where: Path, body: Callable[[int], Any], world: int = WORLD) -> list[Rank]:
    """Fork `world` ranks joined in one gloo group; each runs `body(rank)` and exits 0 (after a
    barrier) or, when it raises, exits 1 at once, as a script would."""
    tag = time.monotonic_ns()
    where.mkdir(parents=True, exist_ok=True)
    procs = [mp.get_context("fork").Process(target=_rank_main, args=(r, world, where, tag, body)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + DEADLINE_S
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = {r for r, p in enumerate(procs) if p.is_alive()}
    for r in sorted(hung):
        procs[r].kill()
        procs[r].join()
    out = []
    for r, p in enumerate(procs):
        rec = where / f"{tag}-{r}.json"
        got = json.loads(rec.read_text()) if rec.exists() else {}
        out.append(Rank(None if r in hung else p.exitcode, got.get("error"), got.get("result"),
                        (where / f"{tag}-{r}.log").read_text(), (where / f"{tag}-{r}.stderr").read_text()))
    return out


def _rank_main(rank: int, world: int, where: Path, tag: int, body: Callable[[int], Any]) -> None:
    code, record = 1, {}
    try:
        err = open(where / f"{tag}-{rank}.stderr", "w")  # noqa: SIM115 - this process's stderr until it exits
        os.dup2(err.fileno(), 2)
        handler = logging.FileHandler(where / f"{tag}-{rank}.log")
        handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
        logging.getLogger("slurmresume").addHandler(handler)
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{where / f'store-{tag}'}", rank=rank, world_size=world)
        try:
            record["result"] = body(rank)
            dist.barrier()  # nobody leaves while a peer is still in a collective
            code = 0
        except Exception as exc:  # noqa: BLE001 - what the script would die of
            record["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    except BaseException:  # noqa: BLE001 - the harness itself failed: reported, never raised into pytest's fork
        record["error"] = "harness: " + traceback.format_exc()
    finally:
        (where / f"{tag}-{rank}.json").write_text(json.dumps(record))
        os._exit(code)


def values(step: int, rank: int) -> torch.Tensor:
    return torch.arange(1024, dtype=torch.float32) + 1000.0 * step + 100_000.0 * rank


def save_two_steps(tmp_path: Path, world: int = WORLD) -> Path:
    """Steps 1 and 2 of a per-rank state ({"model": {"w"}}, different on every rank)."""
    root = tmp_path / "ckpt"

    def save(rank: int) -> None:
        ck = Checkpointer(root, handle_signals=False)
        for step in (1, 2):
            ck.save(step, {"model": {"w": values(step, rank)}})
        ck.close()

    assert [r.exitcode for r in run_ranks(tmp_path / "save", save, world)] == [0] * world
    return root


def restore_into_zeros(root: Path, shape: Callable[[int], int] = lambda rank: 1024,
                       inject: Callable[[int], None] = lambda rank: None) -> Callable[[int], Any]:
    """A rank's body: `inject(rank)`, then restore into zeros of `shape(rank)`; on an error, the
    live tensor must still be all zeros (and the same object)."""

    def body(rank: int) -> dict[str, Any]:
        inject(rank)
        w = torch.zeros(shape(rank))
        state = {"model": {"w": w}}
        ck = Checkpointer(root, handle_signals=False)
        try:
            step = ck.restore(state)
        except Exception:
            assert state["model"]["w"] is w and not w.any(), f"rank {rank}: the live state was touched"
            raise
        exact = torch.equal(w, values(step, rank))
        ck.close()
        return {"step": step, "exact": exact}

    return body


def assert_one_ending(ranks: list[Rank], error: str) -> None:
    """Every rank ended within the deadline, with exit code 1 and the same one-line `error`; no
    rank's output shows gloo's own failure."""
    assert [r.exitcode for r in ranks] == [1] * len(ranks), [(r.exitcode, r.error) for r in ranks]
    assert [r.error for r in ranks] == [error] * len(ranks), [r.error for r in ranks]
    assert "\n" not in error
    for r in ranks:
        assert "gloo" not in r.stderr.lower() and "Connection" not in r.stderr, r.stderr[-3000:]


# -- one rank's plan --------------------------------------------------------------------------------

def test_a_config_error_in_one_ranks_plan_is_raised_on_every_rank_and_no_older_step_is_tried(
        tmp_path: Path) -> None:
    """Rank 1's model does not fit the checkpoint (Linear(8, 4), saved Linear(8, 8)); ranks 0 and
    2 fit. On the old code rank 1 raised ConfigError alone and the others crashed in gloo."""
    root = tmp_path / "ckpt"

    def model(rank: int, out: int = 8) -> torch.nn.Module:
        torch.manual_seed(rank)
        return torch.nn.Linear(8, out)

    def save(rank: int) -> None:
        ck = Checkpointer(root, handle_signals=False)
        for step in (1, 2):
            ck.save(step, {"model": model(rank)})
        ck.close()

    def restore(rank: int) -> Any:
        live = model(100 + rank, 4 if rank == 1 else 8)
        before = {k: v.clone() for k, v in live.state_dict().items()}
        ck = Checkpointer(root, handle_signals=False)
        try:
            return ck.restore({"model": live})
        except Exception:
            assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items()), "the live state was touched"
            raise

    assert [r.exitcode for r in run_ranks(tmp_path / "save", save)] == [0] * WORLD
    ranks = run_ranks(tmp_path / "restore", restore)
    error = ranks[1].error or ""
    assert_one_ending(ranks, error)
    assert error.startswith("ConfigError: rank 1: the checkpoint does not fit state['model']")
    for r in ranks:  # raised at the first step tried: step 1 would not fit either
        assert "falling back" not in r.log and "Traceback" not in r.log


def _plan_raises(on: int, exc: Exception) -> Callable[[int], None]:
    def inject(rank: int) -> None:
        if rank == on:
            def broken(*args: Any, **kwargs: Any) -> Any:
                raise exc
            restoreplan._plan_part = broken  # forked rank: this process only (plan_part looks it up there)
    return inject


def test_an_unexpected_exception_in_one_ranks_plan_is_raised_on_every_rank_naming_it(tmp_path: Path) -> None:
    """A bug in rank 2's plan (a KeyError): every rank raises RankFailedError naming rank 2, the
    type and the message; only rank 2 logs the traceback; no older step is tried."""
    root = save_two_steps(tmp_path)
    ranks = run_ranks(tmp_path / "restore", restore_into_zeros(root, inject=_plan_raises(2, KeyError("no such piece"))))
    error = ranks[2].error or ""
    assert_one_ending(ranks, error)
    assert error.startswith("RankFailedError: rank 2 failed while planning its read of step 2: "
                            "KeyError: 'no such piece'"), error
    assert "Traceback" in ranks[2].log and "KeyError: 'no such piece'" in ranks[2].log
    assert all("Traceback" not in r.log and "falling back" not in r.log for r in ranks[:2])


def test_a_dtensor_on_a_sub_mesh_that_one_new_rank_cannot_plan_ends_the_restore_on_every_rank(
        tmp_path: Path) -> None:
    """The case seen: a DTensor on a mesh over ranks [1, 2] of 3 (a pipeline stage's), restored
    on 4 ranks with the stage on ranks [1, 2, 3]. Rank 3 takes its skeleton from shard 0 (3 % 3),
    which has no "stage" entry: a ConfigError on rank 3 alone."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    root = tmp_path / "ckpt"

    def state(rank: int, world: int, step: int) -> dict[str, Any]:
        on = list(range(1, world))
        mesh = DeviceMesh("cpu", on)
        out: dict[str, Any] = {"plain": torch.full((4,), float(step))}
        if rank in on:
            out["stage"] = distribute_tensor(torch.arange(12.0).reshape(6, 2) + step, mesh, [Shard(0)])
        return out

    def save(rank: int) -> None:
        ck = Checkpointer(root, handle_signals=False)
        ck.save(1, state(rank, 3, 1))
        ck.close()

    def restore(rank: int) -> Any:
        fresh = state(rank, 4, 0)
        before = {k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in fresh.items()}
        ck = Checkpointer(root, handle_signals=False)
        try:
            return ck.restore(fresh)
        except Exception:
            after = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in fresh.items()}
            assert all(torch.equal(after[k], before[k]) for k in before), f"rank {rank}: the live state was touched"
            raise

    assert [r.exitcode for r in run_ranks(tmp_path / "save", save, 3)] == [0] * 3
    ranks = run_ranks(tmp_path / "restore", restore, 4)
    error = ranks[3].error or ""
    assert_one_ending(ranks, error)
    assert error.startswith("ConfigError: rank 3: checkpoint has no entry for state key(s) ['stage']"), error


# -- one rank's read --------------------------------------------------------------------------------

def _read_raises(on: int, exc: Exception, mode: str | None = None) -> Callable[[int], None]:
    """`read_part` on rank `on` raises `exc` (only in `mode`, when given)."""
    def inject(rank: int) -> None:
        if rank != on:
            return
        real = restoreload.read_part  # restoreload._read looks it up in restoreload (imported from restoreplan)

        def broken(*args: Any, **kwargs: Any) -> Any:
            if mode is None or (args[6] if len(args) > 6 else kwargs.get("mode", "stage")) == mode:
                raise exc
            return real(*args, **kwargs)
        restoreload.read_part = broken
    return inject


def test_an_unexpected_exception_in_one_ranks_read_is_raised_on_every_rank(tmp_path: Path) -> None:
    root = save_two_steps(tmp_path)
    ranks = run_ranks(tmp_path / "restore",
                      restore_into_zeros(root, inject=_read_raises(1, RuntimeError("bad\nstaging buffer"))))
    error = ranks[1].error or ""
    assert_one_ending(ranks, error)
    assert error.startswith("RankFailedError: rank 1 failed while reading its part of step 2: "
                            "RuntimeError: bad staging buffer"), error
    assert "Traceback" in ranks[1].log


def test_an_os_error_in_one_ranks_read_falls_back_to_the_older_step_on_every_rank(tmp_path: Path) -> None:
    """A checkpoint problem keeps today's fallback: rank 0's read of step 2 fails with EIO (only
    step 2's), every rank restores step 1 exactly."""
    root = save_two_steps(tmp_path)

    def inject(rank: int) -> None:
        if rank == 0:
            real = restoreload.read_part

            def eio(rank: int, choice: Any, *args: Any, **kwargs: Any) -> Any:
                if choice.step == 2:
                    raise OSError(5, "Input/output error", "shard")
                return real(rank, choice, *args, **kwargs)
            restoreload.read_part = eio

    ranks = run_ranks(tmp_path / "restore", restore_into_zeros(root, inject=inject))
    assert [(r.exitcode, r.result) for r in ranks] == [(0, {"step": 1, "exact": True})] * WORLD, \
        [(r.exitcode, r.error) for r in ranks]
    assert "falling back" in ranks[0].log and "Input/output error" in ranks[0].log


def test_an_exception_in_one_ranks_second_pass_is_raised_on_every_rank(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A part over the staging budget (0): every rank verifies (pass 1), then reads into the live
    tensors (pass 2). Rank 2's second pass raises: every rank raises RankFailedError saying the
    in-memory state is undefined."""
    root = save_two_steps(tmp_path)
    monkeypatch.setenv(ENV_RESTORE_STAGING, "0")  # inherited by the forked ranks

    def body(rank: int) -> Any:
        _read_raises(2, ValueError("torn"), mode="live")(rank)
        ck = Checkpointer(root, handle_signals=False)
        return ck.restore({"model": {"w": torch.zeros(1024)}})

    ranks = run_ranks(tmp_path / "restore", body)
    error = ranks[2].error or ""
    assert_one_ending(ranks, error)
    assert error.startswith("RankFailedError: restoring step 2 under ") and "after every rank had verified it (rank 2 " \
        "failed while reading its part of step 2: ValueError: torn" in error and "state is undefined" in error, error


# -- rank 0's choice ------------------------------------------------------------------------------------

def test_an_unexpected_exception_in_rank_0s_choice_is_raised_on_every_rank(tmp_path: Path) -> None:
    root = save_two_steps(tmp_path)

    def inject(rank: int) -> None:
        if rank == 0:
            def broken(*args: Any, **kwargs: Any) -> Any:
                raise ZeroDivisionError("division by zero")
            restorechoice.choose = broken

    ranks = run_ranks(tmp_path / "restore", restore_into_zeros(root, inject=inject))
    error = ranks[0].error or ""
    assert_one_ending(ranks, error)
    assert error.startswith("RankFailedError: rank 0 failed while choosing the step to restore: "
                            "ZeroDivisionError: division by zero"), error


# -- pure parts ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("exc,world,kind,message", [
    (ConfigError("does not fit"), 3, "config", "rank 1: does not fit"),
    (ConfigError("does not fit"), 1, "config", "does not fit"),
    (CorruptCheckpointError("bad block"), 3, "corrupt", "bad block"),
    (OSError(5, "Input/output error"), 3, "checkpoint", "[Errno 5] Input/output error"),
    (KeyError("x"), 3, "bug", "rank 1 failed while planning: KeyError: 'x' (unexpected: a bug in slurmresume or in "
                              "a state object's methods; the traceback is in rank 1's log)"),
    (RuntimeError("two\n  lines"), 1, "bug", "rank 1 failed while planning: RuntimeError: two lines (unexpected: a "
                                             "bug in slurmresume or in a state object's methods; the traceback is "
                                             "in rank 1's log)"),
])
def test_what_every_rank_learns_of_one_ranks_exception(exc: Exception, world: int, kind: str, message: str) -> None:
    from slurmresume.errors import RankFailedError
    from slurmresume.train.messages import Failure

    f = Failure.on_rank(exc, 1, world, "planning")
    assert (f.kind, f.message, f.cause) == (kind, message, exc)
    assert Failure.from_json(f.to_json()) == f and f.decisive == (kind in ("config", "bug"))
    assert type(f.error()) is {"config": ConfigError, "bug": RankFailedError}.get(kind, type(f.error()))


def test_a_long_unexpected_message_crosses_ranks_cut_short() -> None:
    from slurmresume.train.messages import Failure

    f = Failure.on_rank(RuntimeError("x" * 100_000), 0, 2, "reading")
    assert len(f.message) < 1200


def test_decisive_failures_come_first_whatever_their_rank() -> None:
    corrupt = [{"kind": "corrupt", "message": f"shard {r}"} for r in range(5)]
    config = {"kind": "config", "message": "rank 9: does not fit"}
    assert restoreverdict.first_failures([*corrupt, config]) == [config, *corrupt[:3]]
    assert restoreverdict.first_failures(corrupt) == corrupt[:4]

"""Exact resume of examples/train.py: a run resumed from its step-N checkpoint in a new process
ends with a final checkpoint bitwise equal to the uninterrupted run's, and prints the same
losses. One process, and two ranks through torch.distributed.run (gloo on CPU)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import xxhash
from helpers.core import rewrite_manifest
from helpers.procs import check, printed_final, printed_losses, printed_start, run_example
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.checkpoint.manifest import read_manifest
from slurmresume.checkpoint.store import inspect_dir, list_checkpoints
from slurmresume.tools.compare import compare_checkpoints

# One worker runs this module, so that its module-scoped fixture (a multi-process run) is
# computed once: under xdist each worker that got one of its tests computed it again.
pytestmark = pytest.mark.xdist_group("core_resume")


def _resume_pair(tmp: Path, steps: int, every: int, resume_at: int, nproc: int, *extra: str) -> dict:
    a, b = tmp / "A", tmp / "B"
    args = ("--steps", steps, "--save-every", every, *extra)
    run_a = check(run_example(a, *args, nproc=nproc))
    b.mkdir()
    shutil.copytree(a / step_dir_name(resume_at), b / step_dir_name(resume_at))
    run_b = check(run_example(b, *args, nproc=nproc))
    return {"a": a, "b": b, "out_a": run_a.stdout, "out_b": run_b.stdout}


def _assert_exact(r: dict, steps: int, every: int, resume_at: int, world: int) -> None:
    a, b = r["a"], r["b"]
    assert printed_start(r["out_a"]) == (world, 0)
    assert printed_start(r["out_b"]) == (world, resume_at), r["out_b"]
    expected = list(range(every, steps + 1, every))
    assert [i.step for i in list_checkpoints(a)] == expected[::-1]
    assert [i.step for i in list_checkpoints(b)] == [s for s in expected[::-1] if s >= resume_at]
    for root in (a, b):
        for info in list_checkpoints(root, verify=True):
            assert info.complete and info.verified, (info.path, info.problem)
            assert info.manifest.world_size == world

    final = step_dir_name(steps)
    diffs = compare_checkpoints(a / final, b / final)
    assert diffs == [], "\n".join(map(str, diffs))
    # the printed losses after the resume point are the same text, step for step
    la, lb = printed_losses(r["out_a"]), printed_losses(r["out_b"])
    # (one CI run saw this differ once with equal checkpoints: show both outputs if it recurs)
    assert sorted(lb) == [s for s in sorted(la) if s > resume_at] and lb, \
        f"uninterrupted:\n{r['out_a'][-1500:]}\nresumed:\n{r['out_b'][-1500:]}"
    assert {s: la[s] for s in lb} == lb
    assert printed_final(r["out_a"]) == printed_final(r["out_b"]) != None  # noqa: E711
    assert read_manifest(a / final).metrics == read_manifest(b / final).metrics


@pytest.fixture(scope="module")
def one_proc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _resume_pair(tmp_path_factory.mktemp("resume1"), 40, 20, 20, 1)


@pytest.mark.slow
def test_exact_resume_one_process(one_proc: dict) -> None:
    _assert_exact(one_proc, 40, 20, 20, world=1)


def test_zero_steps_saves_the_start_and_exits_cleanly(tmp_path: Path) -> None:
    """`--steps 0` (set-up only: a smoke test of a script's state) divided by zero in the
    example's learning-rate schedule and exited 1 with a traceback."""
    check(run_example(tmp_path / "ck", "--steps", 0))
    assert [i.step for i in list_checkpoints(tmp_path / "ck", verify=True)] == [0]


@pytest.mark.slow
def test_compare_sees_differences_negative_control(one_proc: dict) -> None:
    a = one_proc["a"]
    diffs = compare_checkpoints(a / step_dir_name(20), a / step_dir_name(40))
    keys = {d.key.split("/", 1)[0] for d in diffs}
    assert {"model", "optimizer", "scheduler", "sampler", "rng.torch_cpu"} <= keys, keys
    assert any(d.key.startswith("model/") and "max |delta|" in d.detail for d in diffs)
    assert all(str(d).startswith("rank 0: ") for d in diffs)


@pytest.mark.slow
def test_compare_is_bitwise_one_flipped_bit(one_proc: dict, tmp_path: Path) -> None:
    """Flip the lowest mantissa bit of one weight (a re-written, fully consistent checkpoint):
    compare reports exactly that tensor."""
    src = one_proc["a"] / step_dir_name(40)
    dst = tmp_path / step_dir_name(40)
    shutil.copytree(src, dst)
    shard = dst / "rank-00000-of-00001.safetensors"
    with safe_open(str(shard), "pt") as f:
        meta = f.metadata()
    tensors = load_file(str(shard))
    name = "model/blocks.layers.0.linear1.weight"
    tensors[name].view(-1).view(torch.int32)[7] ^= 1
    save_file(tensors, str(shard), metadata=meta)
    data = shard.read_bytes()

    def edit(m: dict) -> None:
        m["shards"][0].update(bytes=len(data), xxh3=xxhash.xxh3_64_hexdigest(data))
    rewrite_manifest(dst, edit)
    assert inspect_dir(40, dst, verify=True).verified
    diffs = compare_checkpoints(src, dst)
    assert [(d.key, d.rank) for d in diffs] == [(name, 0)], diffs
    assert "max |delta|" in diffs[0].detail and "data order" in str(diffs[0])


@pytest.mark.slow
def test_exact_resume_two_processes(tmp_path: Path) -> None:
    r = _resume_pair(tmp_path, 30, 10, 10, 2, "--batch-size", "8")
    _assert_exact(r, 30, 10, 10, world=2)
    # each rank wrote its own shard; the two ranks' models agree (DDP) but their RNGs do not
    m = read_manifest(r["a"] / step_dir_name(30))
    assert [s["file"] for s in m.shards] == ["rank-00000-of-00002.safetensors", "rank-00001-of-00002.safetensors"]
    assert m.shards[0]["xxh3"] != m.shards[1]["xxh3"]

"""`slurmresume inspect`: the report on real checkpoints, the streamed stats, the CLI, and a
bounded-memory check on a ~200 MB checkpoint in a subprocess."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.core import rewrite_index, rewrite_manifest, shard, tiny_model
from helpers.procs import REPO
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import slurmresume.cli.commands_inspect  # noqa: F401  (registers `inspect`; cli/__init__.py imports it too)
from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.checkpoint.shardread import read_header
from slurmresume.cli import app
from slurmresume.errors import ConfigError, CorruptCheckpointError, NoCheckpointError
from slurmresume.tools.inspect import _Accumulator, inspect_checkpoint, locate, tensor_stats

ENV = {"COLUMNS": "120", "TERM": "dumb", "NO_COLOR": "1", "SLURMRESUME_CKPT_DIR": ""}
REPORT_KEYS = {"schema", "step", "path", "world_size", "bytes", "created", "created_iso", "metrics", "meta",
               "state", "library", "tensors", "stats_computed", "nan_count", "inf_count"}
TENSOR_KEYS = {"name", "rank", "dtype", "shape", "numel", "bytes", "stats"}
STATS_KEYS = {"min", "max", "mean", "nan_count", "inf_count"}


def run(*args, env: dict | None = None):
    return CliRunner().invoke(app, [str(a) for a in args], env={**ENV, **(env or {})})


def one_error_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert result.stdout == "" and len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


def weights() -> torch.Tensor:
    w = torch.linspace(-3, 5, 3000).reshape(300, 10)
    w[7, 3] = w[100, 0] = w[299, 9] = math.nan
    return w


def halves() -> torch.Tensor:
    h = torch.tensor([1.5, -2.25, 8.0, 0.0] * 100, dtype=torch.bfloat16)
    h[1] = math.inf
    return h


@pytest.fixture
def root(tmp_path) -> Path:
    ckpt = Checkpointer(tmp_path, handle_signals=False)
    state = {"model": tiny_model(1), "weights": weights(), "halves": halves(),
             "counts": torch.arange(-5, 1000, dtype=torch.int64), "step": 7, "note": "hello"}
    ckpt.save(7, state, metrics={"loss": 0.25})
    ckpt.save(9, {"model": tiny_model(2), "step": 9})
    return tmp_path


# -- the report -------------------------------------------------------------------------------

def test_report_without_tensor_values(root):
    r = inspect_checkpoint(*locate("7", root))
    assert (r.step, r.world_size, r.metrics, r.stats_computed) == (7, 1, {"loss": 0.25}, False)
    assert {k.key: (k.kind, k.tensors) for k in r.state} == {
        "model": ("stateful", 4), "weights": ("value", 1), "halves": ("value", 1), "counts": ("value", 1),
        "step": ("value", 0), "note": ("value", 0)}
    assert r.library == ["rng"]
    rows = {t.name: t for t in r.tensors}
    assert (rows["weights"].dtype, rows["weights"].shape, rows["weights"].bytes) == ("F32", [300, 10], 12000)
    assert (rows["halves"].dtype, rows["halves"].bytes) == ("BF16", 800)
    assert rows["model/0.weight"].shape == [8, 4] and all(t.stats is None for t in r.tensors)
    assert {k.key: k.bytes for k in r.state}["model"] == 4 * (32 + 8 + 16 + 2)


def test_stats_find_the_nans_and_infs(root):
    r = inspect_checkpoint(*locate("7", root), tensors=True)
    rows = {t.name: t.stats for t in r.tensors}
    w = weights()
    finite = w[~torch.isnan(w)]
    assert rows["weights"].nan_count == 3 and rows["weights"].inf_count == 0
    assert rows["weights"].min == pytest.approx(finite.min().item())
    assert rows["weights"].max == pytest.approx(finite.max().item())
    assert rows["weights"].mean == pytest.approx(finite.double().mean().item(), rel=1e-9)
    h = halves().float()
    assert (rows["halves"].nan_count, rows["halves"].inf_count) == (0, 1)
    assert (rows["halves"].min, rows["halves"].max) == (-2.25, 8.0)
    assert rows["halves"].mean == pytest.approx(h[torch.isfinite(h)].double().mean().item())
    assert (rows["counts"].min, rows["counts"].max, rows["counts"].mean) == (-5, 999, pytest.approx(497.0))
    assert (r.count("nan_count"), r.count("inf_count")) == (3, 1)


@pytest.mark.parametrize("chunk", [8, 24, 4000, 1 << 20])
def test_chunking_does_not_change_the_stats(root, chunk):
    d = root / step_dir_name(7)
    file = shard(root, 7).name
    size = shard(root, 7).stat().st_size
    header, start = read_header(d, file, size)
    assert tensor_stats(d, file, size, header, start, chunk=chunk) == tensor_stats(d, file, size, header, start)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.floats(width=32), st.just(math.nan), st.just(math.inf)), max_size=60),
       st.integers(1, 16))
def test_accumulator_matches_numpy(values, pieces):
    x = np.array(values, dtype=np.float32)
    acc = _Accumulator(integer=False)
    for part in np.array_split(x, pieces):
        acc.add(part)
    got = acc.result()
    finite = x[np.isfinite(x)]
    assert (got.nan_count, got.inf_count) == (int(np.isnan(x).sum()), int(np.isinf(x).sum()))
    if finite.size:
        assert (got.min, got.max) == (finite.min().item(), finite.max().item())
        assert got.mean == pytest.approx(finite.astype(np.float64).mean(), rel=1e-9, abs=1e-30)
    else:
        assert (got.min, got.max, got.mean) == (None, None, None)


def test_locate(root, tmp_path):
    assert locate("latest", root) == (9, root / step_dir_name(9))
    assert locate(str(root / step_dir_name(7)), None) == (7, root / step_dir_name(7))
    with pytest.raises(ConfigError, match="pass --ckpt-dir"):
        locate("7", None)


def test_refuses_what_is_not_committed(root):
    (root / step_dir_name(5)).mkdir()
    with pytest.raises(NoCheckpointError, match="incomplete"):
        inspect_checkpoint(*locate("5", root))
    with pytest.raises(NoCheckpointError, match="no step 6"):
        inspect_checkpoint(*locate("6", root))
    rewrite_manifest(root / step_dir_name(9), lambda m: m["shards"][0].update(bytes=12345))
    with pytest.raises(CorruptCheckpointError, match="slurmresume verify 9"):
        inspect_checkpoint(*locate("9", root))


def test_a_manifest_index_that_disagrees_with_the_header(root):
    rewrite_index(root / step_dir_name(7), 0, lambda t: next(iter(t.values())).update(shape=[1, 2, 3]))
    with pytest.raises(CorruptCheckpointError, match="disagrees with its shard header"):
        inspect_checkpoint(*locate("7", root))
    rewrite_index(root / step_dir_name(7), 0, lambda t: t.update(ghost=t.pop(next(iter(t)))))
    with pytest.raises(CorruptCheckpointError, match="names no tensor of its shard"):
        inspect_checkpoint(*locate("7", root))


def test_a_header_tensor_missing_from_the_manifest_index(root):
    """--tensors reads every tensor of the header: one the index does not list is refused by
    name (it used to raise KeyError out of inspect)."""
    rewrite_index(root / step_dir_name(7), 0, lambda t: t.pop(next(iter(t))))
    with pytest.raises(CorruptCheckpointError, match="that the manifest's tensor index does not list"):
        inspect_checkpoint(*locate("7", root), tensors=True)


@pytest.mark.slow
def test_two_ranks(tmp_path):
    """A two-rank checkpoint written by two gloo processes: state keys and rows per rank."""
    script = textwrap.dedent(f"""
        import os, sys, torch, torch.distributed as dist
        from slurmresume import Checkpointer
        rank = int(sys.argv[1])
        dist.init_process_group("gloo", init_method="file://{tmp_path}/rdzv", rank=rank, world_size=2)
        state = {{"w": torch.full((4,), float(rank)), "step": 3}}
        if rank == 1:
            state["only1"] = torch.tensor([float("nan")])
        Checkpointer({str(tmp_path / 'ck')!r}, handle_signals=False).save(3, state)
        dist.destroy_process_group()
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(r)], env={**os.environ, "PYTHONPATH": str(REPO)})
             for r in (0, 1)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    r = inspect_checkpoint(*locate("3", tmp_path / "ck"), tensors=True)
    assert r.world_size == 2
    assert {k.key: k.ranks for k in r.state} == {"w": [0, 1], "step": [0, 1], "only1": [1]}
    assert [(t.name, t.rank, t.stats.mean) for t in r.tensors if t.name == "w"] == [("w", 0, 0.0), ("w", 1, 1.0)]
    assert r.count("nan_count") == 1


# -- the command ----------------------------------------------------------------------------

def test_cli_table(root):
    r = run("inspect", "7", "--ckpt-dir", root, "--tensors")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert "step 7" in out and "3 NaN and 1 Inf values in 2 tensor(s)" in out and "loss=0.25" in out
    assert "stateful" in out and "weights" in out and "BF16" in out and "300x10" in out
    assert max(map(len, out.splitlines())) <= 120


def test_cli_json_schema(root):
    r = run("inspect", "latest", "--json", env={"SLURMRESUME_CKPT_DIR": str(root)})
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert set(data) == REPORT_KEYS and data["schema"] == "slurmresume.tools.inspect/1" and data["step"] == 9
    assert data["stats_computed"] is False and data["nan_count"] is None
    r = run("inspect", root / step_dir_name(7), "--json", "--tensors")
    data = json.loads(r.stdout)
    assert all(set(t) == TENSOR_KEYS and set(t["stats"]) == STATS_KEYS for t in data["tensors"])
    assert next(t for t in data["tensors"] if t["name"] == "weights")["stats"]["nan_count"] == 3
    assert data["nan_count"] == 3 and data["inf_count"] == 1
    assert {s["key"]: s["kind"] for s in data["state"]}["model"] == "stateful"
    assert all(k in slurmresume.tools.inspect.__doc__ for k in REPORT_KEYS | TENSOR_KEYS | STATS_KEYS)


@pytest.mark.parametrize("args,message", [
    (["99"], "no step 99 under"),
    (["5"], "is incomplete (no commit marker)"),
    (["/definitely/not/here"], "is not a step number, 'latest', or an existing step directory"),
    (["{root}"], "is not a step directory"),
    (["{root}/step_000000005"], "is incomplete"),
    (["9"], "is corrupt"),
])
def test_cli_bad_input(root, args, message):
    (root / step_dir_name(5)).mkdir()
    shard(root, 9).write_bytes(b"truncated")
    assert message in one_error_line(run("inspect", *[a.format(root=root) for a in args], "-d", root))


def test_cli_roots(tmp_path):
    assert "no checkpoint root" in one_error_line(run("inspect", "7"))
    assert "does not exist" in one_error_line(run("inspect", "latest", "-d", tmp_path / "nope"))
    assert "no complete checkpoint" in one_error_line(run("inspect", "latest", "-d", tmp_path))


def test_cli_help():
    r = run("inspect", "--help")
    assert r.exit_code == 0 and "STEP|PATH|URL" in r.stdout and "Example: slurmresume inspect" in r.stdout


# -- bounded memory ---------------------------------------------------------------------------

PROBE = """
import contextlib, io, json, sys
import slurmresume.cli.commands_inspect, slurmresume.cli.render, slurmresume.tools.inspect  # imports are not the cost
from slurmresume.cli import app

def kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

with contextlib.redirect_stderr(io.StringIO()):  # build the CLI once: its cost is not the checkpoint's
    app(["inspect", "/nonexistent/step_000000001"], standalone_mode=False)
before = kib("VmRSS")
try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
except OSError:
    before = kib("VmHWM")
out = io.StringIO()
with contextlib.redirect_stdout(out):
    app(["inspect", sys.argv[1], "--tensors", "--json"], standalone_mode=False)
print(json.dumps({"growth_kib": kib("VmHWM") - before, "nan_count": json.loads(out.getvalue())["nan_count"]}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_tensor_stats_memory_is_bounded(tmp_path):
    big = torch.randn(25_000_000)  # 100 MB of float32 ...
    big[12_345_678] = math.nan
    state = {"big": big, "half": torch.ones(50_000_000, dtype=torch.bfloat16)}  # ... and 100 MB of bf16
    Checkpointer(tmp_path, handle_signals=False).save(1, state)
    del big, state
    size = shard(tmp_path, 1).stat().st_size
    assert size > 195e6
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / step_dir_name(1))], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["nan_count"] == 1
    assert got["growth_kib"] * 1024 < size / 10, f"peak RSS grew {got['growth_kib']} KiB for a {size}-byte checkpoint"

"""The on-disk format: shards are stock safetensors files (readable by safe_open / load_file,
tensors equal to the model's state_dict), the layout and manifest are as documented, tied
weights are stored once and come back tied."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import xxhash
from helpers.core import shard, step_dir, tiny_model
from safetensors import safe_open
from safetensors.torch import load_file

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import FORMAT, MANIFEST, MARKER, shard_name
from slurmresume.checkpoint.manifest import read_manifest
from slurmresume.checkpoint.shard import SKELETON_KEY


def _save(root: Path, step: int, state: dict, **kw) -> Path:
    return Checkpointer(root, handle_signals=False).save(step, state, **kw)


def _restore(root: Path, state: dict, **kw) -> int:
    return Checkpointer(root, handle_signals=False).restore(state, **kw)


def test_shard_is_stock_safetensors_and_equals_state_dict(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.Linear(7, 3, bias=False))
    model.register_buffer("counts", torch.arange(6, dtype=torch.int64))
    model.register_buffer("mask", torch.tensor([True, False, True]))
    model.register_buffer("bf16", torch.randn(4, dtype=torch.bfloat16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 5)).sum().backward()
    opt.step()
    d = _save(tmp_path, 7, {"model": model, "optimizer": opt, "epoch": 3}, metrics={"loss": 1.25})
    f = shard(tmp_path, 7)

    loaded = load_file(str(f))
    sd = model.state_dict()
    for k, v in sd.items():
        got = loaded[f"model/{k}"]
        assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k
    with safe_open(str(f), framework="pt") as sf:
        assert set(sf.keys()) == set(loaded)
        meta = sf.metadata()
        for k, v in sd.items():
            assert torch.equal(sf.get_tensor(f"model/{k}"), v)
            assert sf.get_slice(f"model/{k}").get_shape() == list(v.shape)
    assert meta["format"] == "pt"
    skeleton = json.loads(meta[SKELETON_KEY])
    assert skeleton["entries"]["epoch"] == {"kind": "value", "value": 3}
    # optimizer momentum buffers are tensors in the shard too
    for i, st in opt.state_dict()["state"].items():
        assert torch.equal(loaded[f"optimizer/state/{i}/momentum_buffer"], st["momentum_buffer"])
    assert "__slurmresume__/rng/torch_cpu" in loaded

    # every tensor is aligned to its itemsize within the file (safetensors' own layout rule)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0
    itemsize = {"F32": 4, "I64": 8, "BOOL": 1, "BF16": 2, "U8": 1}
    for name, info in header.items():
        if name != "__metadata__":
            assert (8 + n + info["data_offsets"][0]) % itemsize[info["dtype"]] == 0, name

    # layout and manifest
    assert d == step_dir(tmp_path, 7) and d.name == "step_000000007"
    assert sorted(os.listdir(d)) == sorted([MARKER, MANIFEST, shard_name(0, 1), "rank-00000.index.json"])
    m = read_manifest(d, 7)
    assert m.raw["format"] == FORMAT == "slurmresume/3" and m.world_size == 1 and m.metrics == {"loss": 1.25}
    index_raw = (d / "rank-00000.index.json").read_bytes()
    assert m.shards == [{"file": "rank-00000-of-00001.safetensors", "rank": 0, "bytes": len(raw),
                         "xxh3": m.shards[0]["xxh3"], "header_xxh3": m.shards[0]["header_xxh3"],
                         "index": "rank-00000.index.json", "index_bytes": len(index_raw),
                         "index_xxh3": xxhash.xxh3_64_hexdigest(index_raw)}]
    assert "tensors" not in m.raw and m.raw["sharded"] == {} and m.raw["elastic"] is False
    index = {t["name"]: t for t in m.tensors}
    assert set(index) == set(loaded)
    assert index["model/0.weight"] == {"name": "model/0.weight", "rank": 0, "dtype": "F32", "shape": [7, 5],
                                       "xxh3": [xxhash.xxh3_64_hexdigest(loaded["model/0.weight"].numpy().tobytes())]}


def test_restore_equals_saved_model_and_optimizer(tmp_path: Path) -> None:
    model = tiny_model(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(3, 4)).pow(2).sum().backward()
        opt.step()
    _save(tmp_path, 2, {"model": model, "optimizer": opt})
    m2 = tiny_model(9)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1e-2)
    assert _restore(tmp_path, {"model": m2, "optimizer": o2}) == 2
    for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict(), o2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for i in s1["state"]:
        for k, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][k]), (i, k)


class Tied(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok = nn.Embedding(11, 6)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.tok.weight


def test_tied_weights_stored_once_and_restored_tied(tmp_path: Path) -> None:
    model = Tied(0)
    assert model.state_dict()["head.weight"].data_ptr() == model.state_dict()["tok.weight"].data_ptr()
    _save(tmp_path, 1, {"model": model})
    keys = set(load_file(str(shard(tmp_path, 1))))
    model_keys = {k for k in keys if k.startswith("model/")}
    assert model_keys == {"model/tok.weight", "model/mid.weight", "model/mid.bias"}, keys
    # the manifest's tensor index has one entry for the tied pair as well
    assert sum(t["name"].startswith("model/") for t in read_manifest(step_dir(tmp_path, 1)).tensors) == 3

    fresh = Tied(1)
    assert not torch.equal(fresh.tok.weight, model.tok.weight)
    assert _restore(tmp_path, {"model": fresh}) == 1
    assert fresh.head.weight is fresh.tok.weight
    assert fresh.head.weight.data_ptr() == fresh.tok.weight.data_ptr()
    assert torch.equal(fresh.tok.weight, model.tok.weight)
    assert torch.equal(fresh.head.weight, model.head.weight)
    assert torch.equal(fresh.mid.weight, model.mid.weight)
    with torch.no_grad():  # still one parameter after the load
        fresh.tok.weight[0, 0] += 1
    assert fresh.head.weight[0, 0] == fresh.tok.weight[0, 0]


def test_equal_values_but_separate_storage_are_not_merged(tmp_path: Path) -> None:
    a = torch.ones(4)
    b = torch.ones(4)
    base = torch.arange(10.0)
    _save(tmp_path, 1, {"t": {"a": a, "b": b, "view": base[2:5], "base": base, "again": a}})
    keys = set(load_file(str(shard(tmp_path, 1))))
    assert {"t/a", "t/b", "t/view", "t/base"} <= keys and "t/again" not in keys
    state = {"t": None}
    assert _restore(tmp_path, state) == 1
    t = state["t"]
    assert t["again"] is t["a"] and t["b"] is not t["a"]
    assert torch.equal(t["view"], torch.tensor([2.0, 3.0, 4.0])) and torch.equal(t["base"], base)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                                   torch.int32, torch.bool, torch.float8_e4m3fn])
def test_dtypes_and_odd_shapes_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    src = torch.randn(3, 5).mul(10).to(dtype)
    state = {"x": {"t": src, "nc": src.t(), "empty": torch.empty(0, 3, dtype=dtype),
                   "scalar": src[1, 1].clone()}}
    _save(tmp_path, 1, state)
    back = {"x": None}
    _restore(tmp_path, back)
    for k, v in state["x"].items():
        got = back["x"][k]
        assert got.dtype == dtype and got.shape == v.shape
        assert torch.equal(got.view(-1).view(torch.uint8) if got.numel() else got,
                           v.contiguous().view(-1).view(torch.uint8) if v.numel() else v), k

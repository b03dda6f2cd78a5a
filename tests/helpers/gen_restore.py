"""Child for tests/test_exact_state.py: save a state holding a torch.Generator and a plain
generator-state tensor, then restore it by the path named in argv[2] ("verify": verify_on_restore,
"fallback": past a damaged newest checkpoint, "default": the default restore)
and draw from both. Prints the draws as JSON; a crash (SIGSEGV) fails the test cleanly."""

import json
import sys
from pathlib import Path

import torch

import slurmresume

root, mode = Path(sys.argv[1]), sys.argv[2]
members = sys.argv[3].split(",")  # "gen" (a torch.Generator), "gen_state" (its state as a tensor)


def make_state() -> dict:
    gen = torch.Generator().manual_seed(7)
    torch.rand(5, generator=gen)  # advance it: a fresh seed would hide a wrong restore
    side = torch.Generator().manual_seed(11)
    torch.rand(3, generator=side)
    # tensors around the generator state put it at a non-zero offset of the read buffer
    return pick({"before": torch.arange(10, dtype=torch.float32), "gen": gen,
                 "gen_state": side.get_state(), "after": torch.ones(3, dtype=torch.float64)})


def pick(state: dict) -> dict:
    return {k: v for k, v in state.items() if k in ("before", "after", *members)}


def draws(state: dict) -> list:
    out = [torch.rand(4, generator=state["gen"]).tolist()] if "gen" in state else []
    if "gen_state" in state:
        side = torch.Generator()
        side.set_state(state["gen_state"])
        out.append(torch.rand(4, generator=side).tolist())
    return out


ckpt = slurmresume.Checkpointer(root, handle_signals=False)
state = make_state()
expected = draws(make_state())
ckpt.save(1, state)
ckpt.save(2, state)
if mode == "fallback":  # damage the newest checkpoint's header so restore falls back to step 1
    shard = next((root / "step_000000002").glob("rank-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[9] = ord("#")
    shard.write_bytes(bytes(data))
fresh = pick({"before": torch.zeros(10), "gen": torch.Generator().manual_seed(0),
              "gen_state": torch.Generator().get_state(), "after": torch.zeros(3, dtype=torch.float64)})
step = slurmresume.Checkpointer(root, handle_signals=False, verify_on_restore=(mode == "verify")).restore(fresh)
t = fresh["after"]  # a plain tensor handed back: owns exactly its bytes
print(json.dumps({"step": step, "draws": draws(fresh), "expected": expected,
                  "owns": t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.nbytes}))

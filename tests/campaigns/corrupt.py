"""Campaign 4: damage after commit.

A root with steps 1, 2, 3 committed (tiny model, plain values, a 64 KiB tensor). Each trial
copies it and damages step 3 (the newest) in one seeded way:

  flip      one bit at a random offset of the shard, the manifest or the marker
  flip-data one bit inside the shard's tensor bytes (what sizes and parsing cannot see)
  zero      a random range of the shard overwritten with zeros (safetensors #762)
  truncate  the shard, manifest or marker cut to a random shorter length
  extend    bytes appended to the shard
  delete    the shard or the manifest removed
  edit      a manifest field changed by hand (marker left alone)
  edit+mark a manifest field changed and the marker re-written to match (format-aware tamper)

Checks per trial:
  restore(verify=True)  returns step 3 only when step 3's data is intact, otherwise falls back to
                        step 2 with a warning naming the damaged file; the data returned is
                        exactly what was saved for that step (else: a partial load, must be 0)
  verify --all          flags step 3, naming the file (in-process verify_checkpoints for every
                        trial; `python -m slurmresume verify --all` for every k-th, exit 1)
  restore()             (default: sizes, no checksums) the same data check, counted apart: by
                        design (DESIGN.md 1) a flipped tensor byte is only caught with verify
  status                does not crash, marks step 3 corrupt when verify says so
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from campaigns.harness import REPO, LogCapture, Report, where

NAME = "corrupt"
DEFAULT_COUNT = 2000
KINDS = ["flip", "flip", "flip-data", "zero", "truncate", "extend", "delete", "edit", "edit+mark"]
CLI_EVERY = 25  # run the real CLI for every k-th trial


def _state(step: int) -> dict[str, Any]:
    import torch
    from helpers.core import tiny_state

    st = tiny_state(step)
    st["big"] = torch.arange(16384, dtype=torch.float32) * (step + 1)
    return st


def _equal(a: dict[str, Any], step: int) -> str | None:
    import torch
    from helpers.core import model_equal

    want = _state(step)
    if not model_equal(a["model"], want["model"]):
        return "model weights differ"
    if not torch.equal(a["big"], want["big"]):
        return "tensor 'big' differs"
    if a["step"] != want["step"] or a["extra"] != want["extra"]:
        return f"plain values differ: {a['step']!r} {a['extra']!r}"
    return None


def _restore(root: Path, verify: bool) -> tuple[int | None, dict[str, Any], BaseException | None, list[str]]:
    from slurmresume import Checkpointer
    state = _state(987654)
    with LogCapture() as logs:
        try:
            with Checkpointer(root, handle_signals=False) as ck:  # closed: an open one keeps its lease beating into root
                step = ck.restore(state, verify=verify)
        except BaseException as exc:  # noqa: BLE001
            return None, state, exc, list(logs.messages)
    return step, state, None, list(logs.messages)


def _damage(rng: random.Random, d: Path, kind: str) -> tuple[str, str, bool]:
    """Damage step directory `d`. Returns (file name, description, data_changed): data_changed
    is False only for edits that leave every tensor and value as saved."""
    from helpers.core import edit_rows, rewrite_manifest

    from slurmresume.checkpoint.layout import MANIFEST, MARKER, shard_name

    shard = d / shard_name(0, 1)
    if kind in ("flip", "flip-data", "zero", "extend") or kind in ("truncate", "delete"):
        if kind in ("flip-data", "zero", "extend"):
            target = shard
        elif kind == "delete":
            target = rng.choice([shard, d / MANIFEST])
        else:
            target = rng.choice([shard, shard, d / MANIFEST, d / MARKER])
        data = bytearray(target.read_bytes())
        if kind == "flip":
            off, bit = rng.randrange(len(data)), rng.randrange(8)
            data[off] ^= 1 << bit
            desc = f"bit {bit} of byte {off}/{len(data)}"
        elif kind == "flip-data":
            (n,) = __import__("struct").unpack("<Q", bytes(data[:8]))
            off, bit = rng.randrange(8 + n, len(data)), rng.randrange(8)
            data[off] ^= 1 << bit
            desc = f"bit {bit} of data byte {off}/{len(data)}"
        elif kind == "zero":
            a = rng.randrange(len(data))
            b = min(len(data), a + rng.randrange(1, 4096))
            changed = any(data[a:b])
            data[a:b] = bytes(b - a)
            desc = f"zeros at [{a}, {b})" + ("" if changed else " (were zero already)")
            if not changed:
                target.write_bytes(bytes(data))
                return target.name, desc, False
        elif kind == "truncate":
            cut = rng.randrange(len(data))
            data = data[:cut]
            desc = f"truncated to {cut}"
        elif kind == "extend":
            data += bytes(rng.randrange(1, 100))
            desc = "extended"
        else:
            target.unlink()
            return target.name, "deleted", True
        target.write_bytes(bytes(data))
        return target.name, desc, True
    field = rng.choice(["metrics", "bytes", "xxh3", "step", "created_iso", "world_size", "format"])
    changed = field not in ("metrics", "created_iso")  # informational fields

    def edit(m: dict[str, Any]) -> None:
        if field == "metrics":
            m["metrics"] = {"step": 3, "loss": 0.001}
        elif field == "bytes":
            m["shards"][0]["bytes"] += rng.choice([-8, 8, 4096])
        elif field == "xxh3":
            m["shards"][0]["xxh3"] = f"{rng.getrandbits(64):016x}"
        elif field == "step":
            m["step"] = 2
        elif field == "created_iso":  # (format 1 edited its tensor index here; format 2 has none)
            m["created_iso"] = "2000-01-01T00:00:00Z"
        elif field == "world_size":
            m["world_size"] = 2
        else:
            m["format"] = "slurmresume/0"

    if kind == "edit+mark":
        rewrite_manifest(d, edit)
        return MANIFEST, f"{field} edited, marker re-written", changed
    m = json.loads((d / MANIFEST).read_bytes())
    edit_rows(m, edit)
    (d / MANIFEST).write_text(json.dumps(m, separators=(",", ":")))
    return MANIFEST, f"{field} edited", True


def run(report: Report, work: Path) -> None:
    from slurmresume import Checkpointer
    from slurmresume.checkpoint.layout import MARKER, step_dir_name
    from slurmresume.checkpoint.store import inspect_dir
    from slurmresume.tools.status import compute_status, verify_checkpoints

    seed, count = report.seed, report.count
    rng = random.Random(seed)
    pristine = work / "pristine"
    ck = Checkpointer(pristine, handle_signals=False)
    for s in (1, 2, 3):
        ck.save(s, _state(s), metrics={"step": s})
    ck.close()
    root = work / "root"
    for t in range(count):
        kind = rng.choice(KINDS)
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(pristine, root)
        d = root / step_dir_name(3)
        fname, desc, changed = _damage(rng, d, kind)
        trial = f"#{t} seed {seed}: {kind} {fname} {desc}"
        report.trials += 1
        report.count_stat(f"kind_{kind}")
        intact3 = inspect_dir(3, d, verify=True).complete
        # -- restore with checksums: the guarantee
        step, state, exc, warnings = _restore(root, verify=True)
        if not report.check(exc is None, trial, f"restore(verify=True) raised {type(exc).__name__}: {exc}"):
            continue
        bad = _equal(state, step) if step in (1, 2, 3) else f"restored step {step}"
        if bad:
            report.count_stat("partial_loads_verify")
        report.check(bad is None, trial, f"restore(verify=True) returned step {step}: {bad} (partial load)")
        if step == 3:
            report.check(intact3 and not changed, trial, f"restore(verify=True) accepted damaged step 3 ({desc})")
            report.count_stat("harmless_damage_accepted")
        else:
            report.check(step == 2, trial, f"restore(verify=True) fell back to {step}, not 2")
            named = [w for w in warnings if str(d) in w and (fname in w or "commit marker" in w
                                                            or kind == "edit+mark")]
            report.check(bool(named), trial, f"no warning names {fname}: {warnings}")
            report.count_stat("detected")
        # -- verify --all
        results = {r.step: r for r in verify_checkpoints(root, every=True)}
        if (d / MARKER).exists():
            r3 = results.get(3)
            if step == 2:
                report.check(r3 is not None and not r3.ok and any(fname in p or "marker" in p or kind == "edit+mark"
                                                                  for p in r3.problems),
                             trial, f"verify --all does not flag {fname}: {r3}")
        report.check(all(results[s].ok for s in (1, 2)), trial, "verify --all flags an intact step")
        if t % CLI_EVERY == 0:
            proc = subprocess.run([sys.executable, "-m", "slurmresume", "verify", "--all", "--ckpt-dir", str(root)],
                                  capture_output=True, text=True, cwd=str(REPO), timeout=120,
                                  env={**os.environ, "COLUMNS": "200"})
            report.count_stat("cli_verify_runs")
            if step == 2 and (d / MARKER).exists():
                cli_named = fname in proc.stderr + proc.stdout or kind == "edit+mark" and str(d) in proc.stderr
                report.check(proc.returncode == 1 and cli_named, trial,
                             f"CLI verify --all: exit {proc.returncode}, {proc.stderr.strip()[-300:]}")
            elif step == 3:
                report.check(proc.returncode == 0, trial, f"CLI verify --all failed on intact data: {proc.stderr}")
        # -- status must not crash
        try:
            st = compute_status(root, verify=True)
            row = next((r for r in st.checkpoints if r.step == 3), None)
            if step == 2 and (d / MARKER).exists():
                report.check(row is not None and row.state in ("corrupt",) or (row is not None and row.verified is False),
                             trial, f"status shows step 3 as {row and row.state}")
        except Exception as e:  # noqa: BLE001
            report.fail(trial, f"status raised {type(e).__name__}: {e}")
        # -- the default restore (sizes only), counted apart
        step0, state0, exc0, _ = _restore(root, verify=False)
        if exc0 is not None:
            report.fail(trial, f"the default restore (no checksums) raised {type(exc0).__name__} at {where(exc0)} "
                               f"instead of falling back: {exc0}")
        else:
            bad0 = _equal(state0, step0) if step0 in (1, 2, 3) else f"restored step {step0}"
            if bad0:
                report.count_stat("partial_loads_default_restore")
                report.stats.setdefault("default_partial_by_kind", {})
                report.stats["default_partial_by_kind"][kind] = report.stats["default_partial_by_kind"].get(kind, 0) + 1
    report.stats.setdefault("partial_loads_verify", 0)
    report.stats.setdefault("partial_loads_default_restore", 0)


"""In-process helpers for checkpoint-core tests: a tiny deterministic state, saving and
restoring it, re-writing a manifest together with its commit marker, recording file opens."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import MANIFEST, MARKER, shard_name, step_dir_name
from slurmresume.checkpoint.manifest import marker_bytes


def tiny_model(step: int) -> nn.Module:
    """A small model whose weights are a deterministic function of `step`."""
    g = torch.Generator().manual_seed(1000 + step)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def tiny_state(step: int) -> dict[str, Any]:
    return {"model": tiny_model(step), "step": step, "extra": {"tag": f"s{step}", "ints": (1, 2, step)}}


def model_equal(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def save_steps(root: Path, steps: list[int], **kwargs: Any) -> Checkpointer:
    ckpt = Checkpointer(root, handle_signals=False, **kwargs)
    for s in steps:
        ckpt.save(s, tiny_state(s), metrics={"step": s})
    return ckpt


def restore_fresh(root: Path, **kwargs: Any) -> tuple[int, dict[str, Any]]:
    """Restore into a state built for a step no checkpoint has (weights differ from all)."""
    state = tiny_state(987654)
    step = Checkpointer(root, handle_signals=False).restore(state, **kwargs)
    return step, state


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / step_dir_name(step)


def shard(root: Path, step: int, rank: int = 0, world: int = 1) -> Path:
    return step_dir(root, step) / shard_name(rank, world)


def rewrite_manifest_raw(d: Path, raw: bytes) -> None:
    """Replace manifest.json and re-write COMMITTED so that it pins the new manifest's hash:
    what an attacker (or a careless hand) who knows the format can do."""
    step = json.loads((d / MARKER).read_bytes())["step"]
    (d / MANIFEST).write_bytes(raw)
    (d / MARKER).write_bytes(marker_bytes(step, raw))


def shard_rows(manifest: dict) -> list[dict]:
    """The shard table of a parsed manifest.json as one dict per rank, whatever its format (format 3
    stores columns: checkpoint/shardtable.py)."""
    from slurmresume.checkpoint.shardtable import rows

    shards = manifest["shards"]
    return rows(shards, manifest["world_size"]) if isinstance(shards, dict) else shards


def edit_rows(data: dict, edit: Callable[[dict], Any]) -> None:
    """Let `edit` change a parsed manifest in place with its shard table as rows (format 2's
    shape, a list of dicts), then store the table back as columns while the manifest still says
    format 3 (an edit that makes it format 2 keeps the rows)."""
    from slurmresume.checkpoint.shardtable import columns

    if isinstance(data.get("shards"), dict):
        data["shards"] = shard_rows(data)
    edit(data)
    if data.get("format") == "slurmresume/3" and isinstance(data.get("shards"), list):
        data["shards"] = columns(data["shards"])


def rewrite_manifest(d: Path, edit: Callable[[dict], Any]) -> dict:
    """Load manifest.json, let `edit` change the dict in place (its shard table as rows, whatever
    the format: `edit_rows`), write it back with a marker that matches. Returns the edited manifest."""
    data = json.loads((d / MANIFEST).read_bytes())
    edit_rows(data, edit)
    rewrite_manifest_raw(d, json.dumps(data, separators=(",", ":")).encode())
    return data


def rewrite_index(d: Path, rank: int, edit: Callable[[dict], Any]) -> None:
    """Format 2: let `edit` change rank `rank`'s tensor index ({name: entry}) in place, and re-seal
    it: its size and digest in the manifest, the manifest's in the marker (a knowing hand)."""
    import xxhash

    path = d / f"rank-{rank:05d}.index.json"
    data = json.loads(path.read_bytes())
    edit(data["tensors"])
    raw = json.dumps(data, separators=(",", ":")).encode()
    path.write_bytes(raw)
    rewrite_manifest(d, lambda m: m["shards"][rank].update(index_bytes=len(raw), index_xxh3=xxhash.xxh3_64_hexdigest(raw)))


# -- which files does a piece of code open? ---------------------------------------------------

_recording: list[list[tuple[str, int]]] = []
_hook_installed = False


def _audit(event: str, args: tuple) -> None:
    if not _recording or event != "open":
        return
    path, _mode, flags = args
    if isinstance(path, int):  # os.fdopen etc.: not a path
        return
    _recording[-1].append((os.fsdecode(path), flags if isinstance(flags, int) else 0))


@contextlib.contextmanager
def record_opens() -> Iterator[list[tuple[str, int]]]:
    """Yields a list that collects (path, flags) of every open() / os.open() in this process,
    plus every path handed to safetensors.safe_open (which opens in Rust, invisible to audit)."""
    global _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit)  # audit hooks cannot be removed; this one is idle when unused
        _hook_installed = True
    import safetensors

    opened: list[tuple[str, int]] = []
    real = safetensors.safe_open

    def spy(filename: Any, *a: Any, **k: Any) -> Any:
        opened.append((os.fsdecode(filename), 0))  # follows links like a plain open
        return real(filename, *a, **k)

    _recording.append(opened)
    safetensors.safe_open = spy
    try:
        yield opened
    finally:
        safetensors.safe_open = real
        _recording.pop()


def effective_targets(opened: list[tuple[str, int]]) -> list[Path]:
    """What each recorded open could have read: the path itself when O_NOFOLLOW was used (a link
    then fails to open), otherwise wherever the path resolves to."""
    out = []
    for path, flags in opened:
        out.append(Path(os.path.abspath(path)) if flags & os.O_NOFOLLOW else Path(os.path.realpath(path)))
    return out


class Hang(BaseException):
    """Raised by `deadline` (a BaseException: library code catching OSError/Exception must not
    swallow it the way it would swallow TimeoutError)."""


@contextlib.contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging forever) if the block takes longer than `seconds`. The alarm
    re-fires every second, and the block fails even if library code swallowed the exception."""
    fired: list[bool] = []

    def fire(signum: int, frame: Any) -> None:
        fired.append(True)
        raise Hang(f"blocked for more than {seconds}s (a FIFO opened without O_NONBLOCK?)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    if fired:
        raise AssertionError(f"the block took more than {seconds}s")


def save_as_world(root: Path, step: int, world: int) -> Path:
    """Commit `tiny_state(step)` as if `world` ranks had saved it (each rank's shard written in
    this process through the same prepare / write_rank / commit protocol)."""
    from slurmresume.checkpoint import commit
    from slurmresume.checkpoint.collective import Group
    from slurmresume.checkpoint.state import flatten
    from slurmresume.train import rng

    root = Path(root)
    decision = commit.prepare(root, step)
    assert decision.action == "write"
    reports = []
    for r in range(world):
        skeleton, tensors = flatten(tiny_state(step), {"rng": rng.capture()})
        reports.append(commit.write_rank(root, step, Group(None, r, world), skeleton, tensors, into=decision.dir))
    commit.raise_if_failed(commit.commit(root, step, reports, None, None, into=decision.dir))
    return step_dir(root, step)


def warn_self(ckpt: Any, sig: int = signal.SIGUSR1, timeout: float = 10.0) -> None:
    """Send this process the warning and wait until `ckpt` has taken it. The library blocks the
    signal in the main thread (so children cannot die of it) and takes it in its own thread, so
    it is recorded a moment after os.kill returns, as a warning from Slurm is; a test that acts
    at the very next step() waits for that moment instead of racing it."""
    os.kill(os.getpid(), sig)
    deadline = time.monotonic() + timeout
    while ckpt.flag.request == 0 and time.monotonic() < deadline:
        time.sleep(0.005)

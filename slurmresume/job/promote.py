"""A node lost whole: its ranks' shards from the peer copy of the memory tier (issue #49 item 4).

With sharded state (FSDP2, no replica) a lost node's pieces are on no survivor, so the ranks'
failure-time save is refused (train/failsave.py) and the requeued job would repeat every step
since the last periodic save. But the memory tier holds, on every surviving node, that node's
ranks' shards of its newest snapshots, and the node after the lost one in the ring holds a
verified copy of the lost node's (job/peercopy.py). Together they are every shard of one step,
under one manifest. The surviving launchers copy them, verified, into the checkpoint root and
commit that step there, with rank 0's manifest and marker byte for byte: the requeued job resumes
from it, having lost at most the steps since that snapshot (`--snapshot-every`).

Who does what (every surviving launcher, after a run whose result names lost nodes, before it
requeues; they meet in the run's shared directory, `<shared>/promote/`, never by a collective):
  1. each posts what it holds (`held-<node>.json`: its own committed memory steps and the replicas
     of the lost nodes, each step with its marker's digest; `holdings`);
  2. the committer (the lowest surviving node) waits for every survivor's post (at most WAIT_S),
     picks the newest step that every survivor holds and of which every lost node's replica is
     held, all with one marker (`choose`, pure); nothing newer than the file tier's newest
     committed step (a committed failure save of that step or later wins): else it posts why not.
     Else it prepares the step's private directory in the root (`checkpoint.commit.prepare`) and
     posts the plan (`plan.json`: step, marker digest, directory);
  3. each survivor copies its node's part of that step and the replicas it holds into it, every
     byte hashed as it is copied and checked against the manifest (`copy_part`), and posts what
     it copied (`copied-<node>.json`);
  4. the committer, once every survivor posted (at most WAIT_S), checks that every file the
     manifest lists is there with its size, then writes the manifest and the marker and publishes
     the step (`checkpoint.commit.commit_bytes`): never a partial step, never two steps' shards
     (one marker digest, every file checked against its manifest).
A survivor that dies or stays silent leaves the directory uncommitted (discarded): the newest
committed step stands, as without this. The outcome is the `memory_promoted` event.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import xxhash

from ..checkpoint.commit import commit_bytes, discard, prepare
from ..checkpoint.layout import MANIFEST, MARKER, step_dir_name
from ..checkpoint.manifest import read_manifest
from ..checkpoint.shardread import split_locator
from ..checkpoint.store import marker_digests, newest_committed, stat_sizes
from ..contract import read_json, write_json
from ..errors import CheckpointError
from .peercopy import replica_root

log = logging.getLogger("slurmresume")

SUBDIR = "promote"
WAIT_S = 60.0  # how long the committer waits for the other survivors' posts, and they for its plan
POLL_S = 0.1
CHUNK = 8 << 20


def holdings(memory: Path, lost: set[int]) -> dict[str, Any]:
    """This launcher's committed memory steps and its replicas of the lost nodes, each step with
    its marker's digest: {"own": {step: digest}, "replicas": {node: {step: digest}}}."""
    return {"own": _steps(memory), "replicas": {str(n): _steps(replica_root(memory, n)) for n in sorted(lost)}}


def choose(held: dict[int, Any], survivors: list[int], lost: set[int]) -> tuple[int, str] | None:
    """Pure, the committer: the newest (step, marker digest) that every survivor holds as its own
    and of which every lost node's replica is held by some survivor, all with the same marker."""
    if not survivors or any(n not in held for n in survivors):
        return None
    candidates = sorted(((int(s), d) for s, d in held[survivors[0]]["own"].items()), reverse=True)
    for step, digest in candidates:
        if not all(held[n]["own"].get(str(step)) == digest for n in survivors):
            continue
        if all(any(held[n]["replicas"].get(str(lo), {}).get(str(step)) == digest for n in survivors) for lo in lost):
            return step, digest
    return None


def copy_part(src: Path, dest: Path, files: list[dict[str, Any]]) -> list[str]:
    """Copy every file of `files` (a manifest's entries) that `src` holds into `dest`, each byte
    hashed as it is copied and checked against its recorded size and digest; the copy is fsynced.
    Returns the names copied. Raises CheckpointError naming a file that does not match."""
    copied = []
    for entry in files:
        name = entry["file"]
        if not os.path.lexists(src / name):
            continue
        hasher, size = xxhash.xxh3_64(), 0
        with open(src / name, "rb") as fin, open(dest / name, "wb") as fout:
            while chunk := fin.read(CHUNK):
                hasher.update(chunk)
                fout.write(chunk)
                size += len(chunk)
            fout.flush()
            os.fsync(fout.fileno())
        if size != entry["bytes"] or hasher.hexdigest() != entry["xxh3"]:
            raise CheckpointError(f"{src / name} does not match its manifest ({size} bytes, xxh3 "
                                  f"{hasher.hexdigest()}; recorded {entry['bytes']}, {entry['xxh3']})")
        copied.append(name)
    return copied


def promote(root: Path, shared: Path, memory: Path, node: int, nodes: int, lost: set[int],
            wait: float = WAIT_S) -> dict[str, Any]:
    """Every surviving launcher (see the module docstring). Returns what happened, for the
    `memory_promoted` event: {"step", "committed", "why"}. Never raises."""
    board = shared / SUBDIR
    survivors = [n for n in range(nodes) if n not in lost]
    try:
        board.mkdir(exist_ok=True)
        write_json(board / f"held-{node}.json", holdings(memory, lost))
        if node == survivors[0]:
            return _commit(root, board, memory, node, survivors, lost, wait)
        plan = _wait_json(board / "plan.json", wait)
        if plan is None or plan.get("step") is None:
            return {"step": None, "committed": False, "why": (plan or {}).get("why", "no plan from the committer")}
        _copy_mine(root, board, memory, node, lost, plan)
        return {"step": plan["step"], "committed": None, "why": "copied this node's part; the committer commits"}
    except (OSError, ValueError, CheckpointError) as exc:
        return {"step": None, "committed": False, "why": f"{type(exc).__name__}: {exc}"}


def _commit(root: Path, board: Path, memory: Path, node: int, survivors: list[int], lost: set[int],
            wait: float) -> dict[str, Any]:
    held = {}
    for n in survivors:
        got = _wait_json(board / f"held-{n}.json", wait)
        if got is None:
            return _refuse(board, f"node {n} did not say what it holds")
        held[n] = got
    picked = choose(held, survivors, lost)
    if picked is None:
        return _refuse(board, "no memory snapshot is held whole by the survivors and the replicas")
    step, digest = picked
    newest = newest_committed(root)
    if newest is not None and newest >= step:
        return _refuse(board, f"step {newest} is committed already (the memory snapshot is of step {step})", step)
    d = memory / step_dir_name(step)
    raw, marker = (d / MANIFEST).read_bytes(), (d / MARKER).read_bytes()
    if xxhash.xxh3_64_hexdigest(marker) != digest:
        return _refuse(board, f"the memory snapshot of step {step} changed on this node", step)
    manifest = read_manifest(d, expected_step=step)
    if any(split_locator(f["file"])[1] is not None for f in manifest.files):
        return _refuse(board, "the per-node shard layout is not promoted yet", step)
    decision = prepare(root, step)
    if decision.action != "write":
        return _refuse(board, decision.error or f"step {step} is committed already", step)
    into = root / decision.dir
    plan = {"step": step, "digest": digest, "into": decision.dir}
    write_json(board / "plan.json", plan)
    try:
        failed: Exception | None = None
        try:
            _copy_mine(root, board, memory, node, lost, plan)
        except (OSError, CheckpointError) as exc:
            failed = exc
        # every other survivor's answer before anything is removed: none is writing into it then
        answers = {n: _wait_json(board / f"copied-{n}.json", wait) for n in survivors if n != node}
        if failed is not None:
            raise failed
        for n, got in answers.items():
            if got is None or not got.get("ok"):
                raise CheckpointError(f"node {n}'s part was not copied: "
                                      f"{(got or {}).get('error') or 'it did not answer'}")
        stat_sizes(into, manifest)  # every file the manifest lists, with its size
    except (OSError, CheckpointError) as exc:
        discard(into)
        return {"step": step, "committed": False, "why": str(exc)}
    outcome = commit_bytes(root, step, raw, marker, into=decision.dir)
    return {"step": step, "committed": outcome.ok, "why": outcome.error if not outcome.ok else
            f"every shard of step {step} from the survivors' memory and node(s) {sorted(lost)}'s replica"}


def _copy_mine(root: Path, board: Path, memory: Path, node: int, lost: set[int], plan: dict[str, Any]) -> None:
    step, into = int(plan["step"]), root / str(plan["into"])
    sources = [memory / step_dir_name(step)] + [replica_root(memory, n) / step_dir_name(step) for n in sorted(lost)]
    try:
        files = read_manifest(sources[0], expected_step=step).files
        copied: list[str] = []
        for src in sources:  # this node's part, then the replicas it holds: each of the plan's save only
            if (src / MARKER).exists() and xxhash.xxh3_64_hexdigest((src / MARKER).read_bytes()) == plan["digest"]:
                copied += copy_part(src, into, files)
        write_json(board / f"copied-{node}.json", {"ok": True, "files": copied})
    except (OSError, CheckpointError) as exc:
        write_json(board / f"copied-{node}.json", {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        raise


def _refuse(board: Path, why: str, step: int | None = None) -> dict[str, Any]:
    write_json(board / "plan.json", {"step": None, "why": why})
    return {"step": step, "committed": False, "why": why}


def _steps(root: Path) -> dict[str, str]:
    return {str(step): digest for step, digest in marker_digests(root).items()}  # JSON keys


def _wait_json(path: Path, wait: float) -> Any:
    end = time.monotonic() + wait
    while True:
        got = read_json(path)
        if got is not None or time.monotonic() >= end:
            return got
        time.sleep(POLL_S)

"""`slurmresume export`: one stock safetensors file with a model's weights from a committed
checkpoint, loadable by `safetensors.torch.load_file` and `model.load_state_dict`.

Streams tensor by tensor (read a tensor's bytes from its shard with pread, write them through the
shard writer), so peak memory stays near the largest tensor, not the model. DTensor / FSDP2
tensors are consolidated from every rank's piece by their global offsets.

Every byte written is first checked, as it is read, against the digests the manifest vouches for
(the headers against the manifest, each 4 MiB block against its digest, as a restore reads; a step
older than block digests has its shards hashed whole first): a flipped bit fails the export with
one line, and the temporary output is removed, so no corrupt weights are ever written.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint import fsio
from ..checkpoint.calibrate import open_sink
from ..checkpoint.jsonenc import loads
from ..checkpoint.manifest import read_manifest
from ..checkpoint.reshard import ShardFiles, read_box
from ..checkpoint.shard import ITEMSIZE, SKELETON_KEY, VERIFY_BLOCK
from ..checkpoint.sharding import Sharded, cover
from ..checkpoint.shardread import (
    Expected,
    byte_view,
    check_blocks,
    digests_of,
    open_read,
    pread_exact,
)
from ..checkpoint.state import validate_skeleton
from ..checkpoint.writer import ShardSink
from ..errors import ConfigError, CorruptCheckpointError

CHUNK = 64 << 20


def _tensor_refs(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(state_dict key, stored tensor name) pairs of an encoded state dict."""
    if isinstance(value, dict) and set(value) == {"__tensor__"}:
        return [(prefix, value["__tensor__"])]
    if isinstance(value, dict) and set(value) == {"__dict__"}:
        items = [(str(k), v) for k, v in value["__dict__"]]
    elif isinstance(value, dict):
        items = list(value.items())
    else:
        return []
    out: list[tuple[str, str]] = []
    for k, v in items:
        out += _tensor_refs(v, f"{prefix}.{k}" if prefix else k)
    return out


def export_model(step_dir: Path, out: Path, only: str = "model", rank: int = 0,
                 progress: Callable[[int, int], None] | None = None, source: str | None = None) -> dict[str, Any]:
    """Write `state[only]`'s tensors of one rank's shard to `out` (atomically). Returns a summary.
    `progress(done, total)` is called after each tensor (the CLI draws a bar on a terminal).
    `source` names the checkpoint in messages and the file's metadata when `step_dir` is a
    local copy (an s3:// step downloaded and verified by slurmresume.mirror.fetch)."""
    label = source or str(step_dir)
    manifest = read_manifest(step_dir)
    if not 0 <= rank < manifest.world_size:
        raise ConfigError(f"--rank {rank} is not in this checkpoint (world size {manifest.world_size})")
    expect = manifest.expected if manifest.has_block_digests else None
    if expect is None:  # written before per-block digests: check the step's shards whole first
        _verify_whole(step_dir, manifest.step, label)
    fds: dict[str, int] = {}
    try:
        return _export(step_dir, out, manifest, only, rank, progress, label, expect, fds)
    finally:
        for fd in fds.values():
            os.close(fd)


def _export(step_dir: Path, out: Path, manifest: Any, only: str, rank: int,
            progress: Callable[[int, int], None] | None, label: str, expect: Callable[[int], Expected | None] | None,
            fds: dict[str, int]) -> dict[str, Any]:
    """`export_model` past its checks: every shard opened is recorded in `fds` (the caller closes
    them), its header checked against the manifest, and every byte written checked against its
    recorded digest before it is written (`_feed_tensor`)."""
    shard = manifest.shards[rank]
    sources: dict[str, tuple[Any, int, int, Expected | None]] = {}

    def source(r: int) -> None:
        s = manifest.shards[r]
        if s["file"] not in sources:
            exp = expect(r) if expect is not None else None
            fd, hdr, start, _ = open_read(step_dir, s["file"], s["bytes"], exp)
            fds[s["file"]] = fd
            sources[s["file"]] = (hdr, start, s["bytes"], exp)

    source(rank)
    header = sources[shard["file"]][0]
    meta = header.get("__metadata__")
    skeleton = loads(meta.get(SKELETON_KEY, "") if isinstance(meta, dict) else "", "skeleton")
    validate_skeleton((), skeleton, None, strict=False)  # entries: a dict of {kind, value} (untrusted)
    entries = skeleton["entries"]
    if only not in entries:
        raise ConfigError(f"checkpoint {label} has no state key {only!r}; it has: "
                          f"{', '.join(sorted(map(str, entries)))}")
    try:
        refs = _tensor_refs(entries[only]["value"])
    except (TypeError, ValueError) as exc:
        raise CorruptCheckpointError(f"checkpoint {label}: the skeleton of state key {only!r} is malformed "
                                     f"({exc})") from None
    if not all(isinstance(name, str) for _, name in refs):
        raise CorruptCheckpointError(f"checkpoint {label}: a tensor reference of {only!r} is not a name")
    if not refs:
        raise ConfigError(f"state key {only!r} in {label} holds no tensors")
    # Replicated tensors (data parallelism) are stored once, in rank 0's shard.
    if skeleton.get("replicated"):
        source(0)
    where: dict[str, str] = {}
    layout, offset = {}, 0
    for key, name in refs:
        if name in manifest.sharded:  # a DTensor: its global tensor, assembled from every rank's piece
            tensor = manifest.sharded[name]
            n = math.prod(tensor.shape) * ITEMSIZE[tensor.dtype]
            layout[key] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + n]}
            offset += n
            continue
        where[name] = next((f for f, (h, _, _, _) in sources.items() if isinstance(h.get(name), dict)), "")
        if not where[name]:
            raise CorruptCheckpointError(f"tensor {name!r} is referenced but missing from {shard['file']}")
        info = sources[where[name]][0][name]
        n = info["data_offsets"][1] - info["data_offsets"][0]
        layout[key] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + n]}
        offset += n
    meta = {"format": "pt", "slurmresume.source": label, "slurmresume.step": str(manifest.step)}
    raw = json.dumps({"__metadata__": meta, **layout}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp.{os.getpid()}")
    pieces = ShardFiles(step_dir, manifest.shards, expect)
    sink = open_sink(tmp)
    try:
        sink.feed(len(raw).to_bytes(8, "little") + raw)
        buf = bytearray(CHUNK)
        for done, (_key, name) in enumerate(refs, 1):
            if progress is not None:
                progress(done, len(refs))
            if name in manifest.sharded:
                _feed_global(sink, pieces, manifest.sharded[name])
                continue
            hdr, start, _, exp = sources[where[name]]
            _feed_tensor(sink, fds[where[name]], step_dir / where[name], name, hdr, start, exp, buf)
        sink.finish()
        fsio.rename(tmp, out, "export")
    except BaseException:
        sink.abort()
        fsio._unlink_quiet(tmp)
        raise
    finally:
        pieces.close()
    return {"step": manifest.step, "out": str(out), "tensors": len(refs), "bytes": out.stat().st_size}


def _verify_whole(step_dir: Path, step: int, label: str) -> None:
    """A step without per-block digests: every shard hashed whole against the manifest first."""
    from ..checkpoint.store import inspect_dir

    info = inspect_dir(step, step_dir, verify=True)
    if not info.complete:
        raise CorruptCheckpointError(f"checkpoint {label}: {info.problem}; nothing exported")


def _feed_tensor(sink: ShardSink, fd: int, path: Path, name: str, header: Any, start: int, expect: Expected | None,
                 buf: bytearray) -> None:
    """Stream one tensor's bytes from its shard, each CHUNK (whole VERIFY_BLOCK blocks) checked
    against the digests the manifest vouches for before it is fed to the writer."""
    begin, end = header[name]["data_offsets"]
    digests = digests_of(expect, header, name, path) if expect is not None else None
    if digests is not None and len(digests) != -(-(end - begin) // VERIFY_BLOCK):
        raise CorruptCheckpointError(f"shard {path}: the manifest records {len(digests)} checksum blocks for "
                                     f"tensor {name!r} of {end - begin} bytes")
    for pos in range(0, end - begin, CHUNK):
        view = memoryview(buf)[: min(CHUNK, end - begin - pos)]
        pread_exact(fd, view, start + begin + pos, path)
        if digests is not None:
            check_blocks(view, pos // VERIFY_BLOCK, digests, path, name)
        sink.feed(view, reused=True)


def _feed_global(sink: ShardSink, files: ShardFiles, tensor: Sharded) -> None:
    """Stream one DTensor's global bytes, read (and, when `files` verifies, checked against the
    manifest's digests) by `reshard.read_box`. Pieces that are whole rows (dim-0 sharding, the
    FSDP2 default) go in slabs of rows of about CHUNK bytes, so memory stays near one CHUNK; any
    other sharding is assembled in one tensor of the global size first (memory ~ that tensor)."""
    import torch

    from ..checkpoint.shard import TORCH_DTYPES

    shape = tuple(tensor.shape)
    hits = cover(tensor, (0,) * len(shape), shape)
    dtype = TORCH_DTYPES[tensor.dtype]
    if shape and all(p.shape[1:] == shape[1:] for p, _, _ in hits):
        row = max(1, math.prod(shape[1:]) * ITEMSIZE[tensor.dtype])
        rows = max(1, CHUNK // row)
        for first in range(0, shape[0], rows):
            box = (min(rows, shape[0] - first), *shape[1:])
            dest = torch.empty(box, dtype=dtype)
            read_box(files, tensor, (first,) + (0,) * (len(shape) - 1), box, dest)
            sink.feed(byte_view(dest))
        return
    dest = torch.empty(shape, dtype=dtype)
    read_box(files, tensor, (0,) * len(shape), shape, dest)
    sink.feed(byte_view(dest))

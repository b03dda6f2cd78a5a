"""`slurmresume export`: one stock safetensors file with a model's weights from a committed
checkpoint, loadable by `safetensors.torch.load_file` and `model.load_state_dict`.

Streams tensor by tensor (read a tensor's bytes from its shard with pread, write them through the
shard writer), so peak memory stays near the largest tensor, not the model. DTensor / FSDP2
tensors are consolidated from every rank's piece by their global offsets.
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
from ..checkpoint.shard import ITEMSIZE, SKELETON_KEY
from ..checkpoint.sharding import Sharded, cover
from ..checkpoint.shardread import byte_view, open_checked, read_header
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
    shard = manifest.shards[rank]
    header, data_start = read_header(step_dir, shard["file"], shard["bytes"])
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
    sources = {shard["file"]: (header, data_start, shard["bytes"])}
    first = manifest.shards[0]
    if first["file"] not in sources and skeleton.get("replicated"):
        h0, d0 = read_header(step_dir, first["file"], first["bytes"])
        sources[first["file"]] = (h0, d0, first["bytes"])
    where: dict[str, str] = {}
    layout, offset = {}, 0
    for key, name in refs:
        if name in manifest.sharded:  # a DTensor: its global tensor, assembled from every rank's piece
            tensor = manifest.sharded[name]
            n = math.prod(tensor.shape) * ITEMSIZE[tensor.dtype]
            layout[key] = {"dtype": tensor.dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + n]}
            offset += n
            continue
        where[name] = next((f for f, (h, _, _) in sources.items() if isinstance(h.get(name), dict)), "")
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
    fds = {f: open_checked(step_dir, f, size) for f, (_, _, size) in sources.items()}
    pieces = ShardFiles(step_dir, manifest.shards)
    sink = open_sink(tmp)
    try:
        sink.feed(len(raw).to_bytes(8, "little") + raw)
        buf = bytearray(CHUNK)
        for done, (_key, name) in enumerate(refs, 1):
            if progress is not None:
                progress(done, len(refs))
            if name in manifest.sharded:
                _feed_global(sink, pieces, manifest.sharded[name], buf)
                continue
            hdr, start, _ = sources[where[name]]
            begin, end = hdr[name]["data_offsets"]
            pos = start + begin
            while pos < start + end:
                n = os.preadv(fds[where[name]], [memoryview(buf)[: min(CHUNK, start + end - pos)]], pos)
                sink.feed(memoryview(buf)[:n], reused=True)
                pos += n
        sink.finish()
        fsio.rename(tmp, out, "export")
    except BaseException:
        sink.abort()
        fsio._unlink_quiet(tmp)
        raise
    finally:
        pieces.close()
        for fd in fds.values():
            os.close(fd)
    return {"step": manifest.step, "out": str(out), "tensors": len(refs), "bytes": out.stat().st_size}


def _feed_global(sink: ShardSink, files: ShardFiles, tensor: Sharded, buf: bytearray) -> None:
    """Stream one DTensor's global bytes. Pieces that are whole rows (dim-0 sharding, the FSDP2
    default) are copied in order in CHUNK slices, so memory stays at one CHUNK; any other
    sharding is assembled in one tensor of the global size first (memory ~ that tensor)."""
    shape = tuple(tensor.shape)
    hits = cover(tensor, (0,) * len(shape), shape)
    if all(p.shape[1:] == shape[1:] for p, _, _ in hits):
        for piece, _, _ in sorted(hits, key=lambda h: h[1][:1]):
            fd, pos, path = files.piece(piece.rank, tensor, piece.shape)
            end = pos + piece.numel * ITEMSIZE[tensor.dtype]
            while pos < end:
                n = os.preadv(fd, [memoryview(buf)[: min(CHUNK, end - pos)]], pos)
                if n <= 0:
                    raise CorruptCheckpointError(f"shard {path} ended early while reading")
                sink.feed(memoryview(buf)[:n], reused=True)
                pos += n
        return
    import torch

    from ..checkpoint.shard import TORCH_DTYPES

    dest = torch.empty(shape, dtype=TORCH_DTYPES[tensor.dtype])
    read_box(files, tensor, (0,) * len(shape), shape, dest)
    sink.feed(byte_view(dest))

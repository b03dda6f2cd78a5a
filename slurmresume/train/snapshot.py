"""Consistent in-memory snapshots of a state's tensors for asynchronous saves.

Each tensor is copied into a CPU buffer that is reused across saves (same name, shape and
dtype), so memory does not grow: at most one CPU copy of the state. CUDA tensors go to pinned
buffers on a side stream; the training stream then waits on that copy (a GPU-side wait, the host
does not block), so the next optimizer step cannot change a tensor before it is copied.
"""

from __future__ import annotations

from typing import Any


class SnapshotPool:
    def __init__(self) -> None:
        self.buffers: dict[str, Any] = {}
        self._stream: Any = None

    def snapshot(self, tensors: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], Any]:
        """Copies of `tensors` (main thread). Returns (copies, ready) where `ready()` must be
        called, from any thread, before the copies are read."""
        import torch

        cuda = [t for _, t in tensors if t.is_cuda]
        stream = None
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
        out: list[tuple[str, Any]] = []
        live = set()
        for name, t in tensors:
            live.add(name)
            buf = self.buffers.get(name)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=bool(t.is_cuda))
                self.buffers[name] = buf
            if t.is_cuda:
                with torch.cuda.stream(stream):
                    buf.copy_(t.detach(), non_blocking=True)
                    t.record_stream(stream)
            else:
                buf.copy_(t.detach())
            out.append((name, buf))
        for stale in set(self.buffers) - live:
            del self.buffers[stale]
        if stream is None:
            return out, lambda: None
        event = stream.record_event()
        torch.cuda.current_stream().wait_event(event)  # training waits for the copy, on the GPU
        return out, event.synchronize

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

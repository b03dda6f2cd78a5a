"""The model shapes the scale scripts measure (scale_manifest.py, bench_scale.py,
bench_scale_dcp.py): every parameter of a Llama-style model and FSDP2's Shard(0) split of it.

Kept in one place so the three scripts measure the same state."""

from __future__ import annotations

# (hidden, layers, ffn, vocab, kv width): Llama-2 7B, Llama-3 70B, Llama-3.1 405B; "tiny" (the same
# 9 tensors per layer, 2 layers) is for the tests' runs of the harnesses
MODELS = {"7B": (4096, 32, 11008, 32000, 4096), "70B": (8192, 80, 28672, 128256, 1024),
          "405B": (16384, 126, 53248, 128256, 1024), "tiny": (256, 2, 512, 8192, 256)}
MOMENTS = ("param", "exp_avg", "exp_avg_sq")  # FSDP2 keeps sharded params fp32, and Adam's two moments


def parameters(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """(name, global shape) of every parameter of `model`, in module order."""
    d, layers, ffn, vocab, kv = MODELS[model]
    out = [("tok_embeddings.weight", (vocab, d)), ("norm.weight", (d,)), ("output.weight", (vocab, d))]
    for i in range(layers):
        for name, shape in (("attention.wq", (d, d)), ("attention.wk", (kv, d)), ("attention.wv", (kv, d)),
                            ("attention.wo", (d, d)), ("feed_forward.w1", (ffn, d)), ("feed_forward.w2", (d, ffn)),
                            ("feed_forward.w3", (ffn, d)), ("attention_norm", (d,)), ("ffn_norm", (d,))):
            out.append((f"layers.{i}.{name}.weight", shape))
    return out


def chunk0(dim0: int, world: int, rank: int) -> tuple[int, int]:
    """torch.chunk along dim 0, as FSDP2's Shard(0): (offset, rows); trailing ranks may get 0."""
    size = -(-dim0 // world)
    start = min(rank * size, dim0)
    return start, max(0, min(size, dim0 - start))

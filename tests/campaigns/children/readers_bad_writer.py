"""Racing-readers campaign, the negative control: a writer that breaks the protocol as
safetensors #762 did (the manifest and the marker first, then the shard preallocated to its
final size and filled in place, 64 KiB at a time), until STOP exists. The readers must catch it.

    python tests/campaigns/children/readers_bad_writer.py ROOT STOP
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import xxhash

from slurmresume.checkpoint.manifest import marker_bytes


def main(argv: list[str]) -> int:
    root, stop = Path(argv[0]), Path(argv[1])
    root.mkdir(parents=True, exist_ok=True)
    step = 0
    while not stop.exists():
        step += 1
        data = os.urandom(1 << 20)
        d = root / f"step_{step:09d}"
        d.mkdir()
        m = {"format": "slurmresume/1", "step": step, "world_size": 1, "created": time.time(), "tensors": [],
             "shards": [{"file": "rank-00000-of-00001.safetensors", "rank": 0, "bytes": len(data),
                         "xxh3": xxhash.xxh3_64_hexdigest(data)}], "metrics": None, "meta": None}
        raw = json.dumps(m).encode()
        (d / "manifest.json").write_bytes(raw)
        (d / "COMMITTED").write_bytes(marker_bytes(step, raw))
        with open(d / "rank-00000-of-00001.safetensors", "wb") as f:
            f.truncate(len(data))
            for i in range(0, len(data), 1 << 16):
                f.seek(i)
                f.write(data[i:i + (1 << 16)])
                f.flush()
                time.sleep(0.002)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

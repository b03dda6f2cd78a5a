"""Racing-readers campaign, a reader: until STOP exists, list the root (find_latest or
list_checkpoints, alternating; sizes only, as restore does) and, for every checkpoint it is told
is complete, at once hash every shard its manifest lists (size and xxh3) and check that the
manifest and marker are still there. One JSON line per checked checkpoint in LOG ("bad" says
what was wrong; "dir_gone" and "newer_now" tell a prune apart), one per listing with the count of
incomplete ones seen, and a "crash" line for any exception. ME (0, 1, 2) staggers the readers.

    python tests/campaigns/children/readers_reader.py ROOT STOP LOG ME
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from slurmresume.checkpoint.shardread import hash_file
from slurmresume.checkpoint.store import find_latest, list_checkpoints
from slurmresume.errors import CorruptCheckpointError


def main(argv: list[str]) -> int:
    root, stop, me = Path(argv[0]), Path(argv[1]), int(argv[3])
    with open(argv[2], "a") as log:
        n = 0
        while not stop.exists():
            n += 1
            try:
                infos = [find_latest(root, warn=False)] if (n + me) % 2 else list_checkpoints(root)
                newest = max((i.step for i in infos if i is not None and i.complete), default=None)
                for info in infos:
                    if info is None or not info.complete:
                        continue
                    rec: dict[str, Any] = {"step": info.step, "newest": info.step == newest,
                                           "how": "latest" if (n + me) % 2 else "list"}
                    try:
                        assert info.manifest is not None  # find_latest returns complete ones only
                        for s in info.manifest.shards:
                            digest = hash_file(info.path, s["file"], s["bytes"])
                            if digest != s["xxh3"]:
                                rec["bad"] = f"{s['file']} checksum {digest} != {s['xxh3']}"
                        for f in ("manifest.json", "COMMITTED"):
                            if not (info.path / f).is_file():
                                rec["bad"] = f"{f} missing"
                    except CorruptCheckpointError as exc:
                        rec["bad"] = str(exc)
                    rec["dir_gone"] = not os.path.lexists(info.path)
                    if "bad" in rec and rec["dir_gone"]:
                        now = find_latest(root, warn=False)
                        rec["newer_now"] = now is not None and now.step > info.step
                    log.write(json.dumps(rec) + "\n")
                incomplete = sum(1 for i in infos if i is not None and not i.complete)
                log.write(json.dumps({"incomplete_seen": incomplete}) + "\n")
            except Exception:
                log.write(json.dumps({"crash": traceback.format_exc()[-1500:]}) + "\n")
            log.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

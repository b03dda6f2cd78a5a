#!/usr/bin/env python3
"""What a bucket-only checkpoint root (no shared filesystem) would cost an emergency save.

    bash scripts/objstore.sh up && . <(bash scripts/objstore.sh env)
    python3 scripts/bench_bucket_root.py [--mib 256] [--rounds 3] [--bucket slurmresume-bench]

Per round, interleaved, for one rank's checkpoint of --mib MiB:
  local save   Checkpointer.save to a fresh local root: what an emergency save costs today
               (the mirror uploads it afterwards, after the requeue if need be)
  upload       transfer.upload_step of that committed step: shard (multipart), manifest, the
               conditional marker and its read-back. A save straight to the bucket cannot commit
               before this much is done: the marker must follow every byte. So a bucket-only
               emergency save costs at least `upload`, and `local save + upload` when it
               stages locally first.
Prints medians and one JSON object. Loopback SeaweedFS is the optimistic case: a real object
store is reached over the cluster's uplink, shared by every node saving at once.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from slurmresume import Checkpointer
from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.mirror import S3Location
from slurmresume.mirror.transfer import upload_step
from slurmresume.storage.s3 import client


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB (default: 256)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default: 3)")
    p.add_argument("--bucket", default="slurmresume-bench", help="bucket (default: slurmresume-bench)")
    args = p.parse_args()
    s3 = client()
    try:
        s3.create_bucket(Bucket=args.bucket)
    except Exception as exc:  # already there
        if "BucketAlready" not in str(exc):
            raise
    state = {"w": torch.randn(args.mib << 18)}  # MiB * 2**20 / 4 bytes
    work = Path(tempfile.mkdtemp(prefix="bench-root-"))
    times: dict[str, list[float]] = {"local_save": [], "upload": []}
    try:
        for r in range(args.rounds):
            root = work / f"r{r}"
            ckpt = Checkpointer(root, handle_signals=False)
            t = time.perf_counter()
            ckpt.save(1, state)
            times["local_save"].append(time.perf_counter() - t)
            ckpt.close()
            loc = S3Location(args.bucket, f"root-{uuid.uuid4().hex[:10]}")
            t = time.perf_counter()
            upload_step(s3, loc, root / step_dir_name(1), 1)
            times["upload"].append(time.perf_counter() - t)
            shutil.rmtree(root)
            print(f"round {r + 1}/{args.rounds}: local save {times['local_save'][-1]:.2f} s, "
                  f"upload {times['upload'][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    summary = {"mib": args.mib, "rounds": args.rounds, "local_save_s": round(med["local_save"], 3),
               "upload_s": round(med["upload"], 3),
               "bucket_only_save_s_at_least": round(med["upload"], 3),
               "staged_bucket_save_s": round(med["local_save"] + med["upload"], 3),
               "ratio_staged_over_local": round((med["local_save"] + med["upload"]) / med["local_save"], 2)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()

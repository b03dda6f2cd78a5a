"""`python -m slurmresume.mirror push|pull ROOT s3://BUCKET/PREFIX [--step N]`: one transfer
by hand (moving a run between clusters; the crash tests kill this process mid-upload)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import SlurmResumeError
from ..storage import BucketRoot, DirRoot
from ..storage.s3 import parse_s3_url
from .transfer import download_step, upload_step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m slurmresume.mirror", description=__doc__)
    p.add_argument("action", choices=["push", "pull"], help="push: local -> bucket; pull: bucket -> local")
    p.add_argument("root", type=Path, help="local checkpoint root")
    p.add_argument("url", help="s3://BUCKET/PREFIX")
    p.add_argument("--step", type=int, default=None, help="step to move (default: the newest complete)")
    args = p.parse_args(argv)
    try:
        bucket = BucketRoot(parse_s3_url(args.url))
        loc, s3 = bucket.loc, bucket.s3
        step = args.step
        if args.action == "push":
            if step is None:
                info = DirRoot(args.root).latest()
                if info is None:
                    raise SlurmResumeError(f"no complete checkpoint under {args.root}")
                step = info.step
            from ..checkpoint.layout import step_dir_name

            result = upload_step(s3, loc, args.root / step_dir_name(step), step)
        else:
            if step is None:
                newest = bucket.latest()
                if newest is None:
                    raise SlurmResumeError(f"no complete checkpoint on {loc.url}")
                step = newest.step
            result = download_step(s3, loc, step, args.root)
    except SlurmResumeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"step {result.step}: {result.action} ({result.bytes} bytes, {result.seconds:.2f} s)")
    return 0 if result.action != "conflict" else 1


if __name__ == "__main__":
    sys.exit(main())

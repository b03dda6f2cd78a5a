"""Object-storage mirror: committed steps copied to `s3://BUCKET/PREFIX`, with the same commit.

The bucket holds one folder per step, like a local root (`PREFIX/step_000001200/COMMITTED`),
with the shards and manifest of the commit in the attempt folder the marker names
(`step_000001200/attempt-<random>/rank-*.safetensors`, `manifest.json`; storage/bucketcommit.py), so the
format's guarantees carry over and no other writer can touch what a marker commits:

- upload (`transfer.upload_step`): shards and manifest into this attempt's own folder, the
  marker last with a conditional write (`If-None-Match: *`) naming that folder: a marker is
  never overwritten and never appears before its files; the writer then reads the marker back
  and compares its own token.
- download (`transfer.download_step`): parallel ranged GETs into a hidden directory, each
  part retried from its first missing byte (ranges.py), every shard's xxh3 checked against
  the manifest, then one rename into the local root.
- deletion (`storage.bucketsteps.delete_step`): marker first, so a half-deleted step is never complete.
- timeouts, tries and deadlines: storage/settings.py; what killed transfers leave: leftovers.py (a
  run's own failed attempts: own.py, removed by the run as soon as the bucket answers).

`Mirror` (background.py) is what `Checkpointer(mirror=...)` uses: one background uploader on
rank 0 and a pull on restore. boto3 is imported only on a bucket's path (the `[s3]` extra); the
endpoint, credentials and region come from the standard AWS environment and config files.

This package copies; reading a bucket is storage/'s (`storage.BucketRoot` over
storage/bucketsteps.py, the commit's format in storage/bucketcommit.py, the object-store seam
storage/s3.py and its bounds storage/settings.py): the mirror stands on the storage interface,
never the other way (scripts/import_graph.py `storage_imports_mirror` holds it).
"""

from __future__ import annotations

from ..storage.s3 import S3Location, is_s3_url, parse_s3_url

__all__ = ["Mirror", "S3Location", "is_s3_url", "parse_s3_url"]


def __getattr__(name: str) -> object:
    if name == "Mirror":
        from .background import Mirror

        return Mirror
    raise AttributeError(name)

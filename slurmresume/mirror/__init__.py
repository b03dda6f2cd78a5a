"""Object-storage mirror: committed steps copied to `s3://BUCKET/PREFIX`, with the same commit.

The bucket holds the same layout as a local root (`PREFIX/step_000001200/rank-*.safetensors`,
`manifest.json`, `COMMITTED`), so the format's guarantees carry over without renames:

- upload (`transfer.upload_step`): shards and manifest first, the marker last with a
  conditional write (`If-None-Match: *`): a marker is never overwritten and never appears
  before its files; the writer then reads the marker back and compares its own token.
- download (`transfer.download_step`): parallel ranged GETs into a hidden directory, every
  shard's xxh3 checked against the manifest, then one rename into the local root.
- deletion (`remote.delete_step`): marker first, so a half-deleted step is never complete.

`Mirror` (background.py) is what `Checkpointer(mirror=...)` uses: one background uploader on
rank 0 and a pull on restore. boto3 is imported only here (the `[s3]` extra); the endpoint,
credentials and region come from the standard AWS environment and config files.
"""

from __future__ import annotations

from .s3 import S3Location, is_s3_url, parse_s3_url

__all__ = ["Mirror", "S3Location", "is_s3_url", "parse_s3_url"]


def __getattr__(name: str) -> object:
    if name == "Mirror":
        from .background import Mirror

        return Mirror
    raise AttributeError(name)

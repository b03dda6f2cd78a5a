"""The object-store seam: `s3://` locations, the boto3 client, and the few calls we make.

Every call that matters for the commit crosses `fsio.fault_point("mirror.<label>")`, so the crash
tests can SIGKILL the uploading process at a named place (SLURMRESUME_TEST_KILL_AT, see
checkpoint/fsio.py). Errors from botocore become `CheckpointError`s naming the object.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from ..checkpoint.layout import parse_step_dir, step_dir_name
from ..errors import CheckpointError, ConfigError, CorruptCheckpointError, UnreadableCheckpointError

T = TypeVar("T")
WRITER_META = "slurmresume-writer"  # object metadata on the marker: the token of whoever wrote it
_BUCKET_RE = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_SEGMENT_RE = re.compile(r"[A-Za-z0-9_.=+@,-]+")


@dataclass(frozen=True)
class S3Location:
    """`s3://bucket/prefix`: where a mirror keeps its step folders (prefix may be empty)."""

    bucket: str
    prefix: str = ""

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def __str__(self) -> str:
        return self.url

    def step_prefix(self, step: int) -> str:
        return f"{self.prefix}/{step_dir_name(step)}/" if self.prefix else f"{step_dir_name(step)}/"

    def key(self, step: int, name: str) -> str:
        return self.step_prefix(step) + name

    def step_url(self, step: int) -> str:
        return f"s3://{self.bucket}/{self.step_prefix(step)}".rstrip("/")


def is_s3_url(value: object) -> bool:
    """True for "s3://..." (and "s3:/..." as pathlib leaves it after Path("s3://b/p"))."""
    return str(value).startswith("s3:/")


def parse_s3_url(value: str | os.PathLike[str]) -> S3Location:
    """`s3://BUCKET[/PREFIX]` -> S3Location. ConfigError naming what is wrong otherwise."""
    text = os.fspath(value)
    if not is_s3_url(text):
        raise ConfigError(f"mirror {text!r} is not an s3:// URL: use s3://BUCKET/PREFIX")
    rest = text[len("s3:/"):].lstrip("/").rstrip("/")
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET_RE.fullmatch(bucket) or ".." in bucket:
        raise ConfigError(f"mirror {text!r}: bucket {bucket!r} is not a valid S3 bucket name "
                          "(3-63 characters: lowercase letters, digits, '.' and '-')")
    parts = prefix.split("/") if prefix else []
    for part in parts:
        if part in ("", ".", "..") or not _SEGMENT_RE.fullmatch(part):
            raise ConfigError(f"mirror {text!r}: prefix part {part!r} is not allowed "
                              "(no empty, '.' or '..' parts; letters, digits and _ . = + @ , -)")
    return S3Location(bucket, "/".join(parts))


def split_step_url(url: str) -> tuple[S3Location, int | None]:
    """`s3://B/P` -> (location, None); `s3://B/P/step_000001200` -> (location of P, 1200)."""
    loc = parse_s3_url(url)
    head, _, last = loc.prefix.rpartition("/")
    step = parse_step_dir(last) if last else None
    if step is None:
        return loc, None
    return S3Location(loc.bucket, head), step


def client(settings: Any = None) -> Any:
    """A boto3 S3 client from the standard AWS environment/config (AWS_ENDPOINT_URL,
    AWS_PROFILE, AWS_ACCESS_KEY_ID, AWS_DEFAULT_REGION, ~/.aws/config), its timeouts and tries
    from `settings` (default: settings.MirrorSettings.from_env()). Thread-safe."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise ConfigError("an s3:// mirror needs boto3: pip install 'slurmresume[s3]'") from None
    from .settings import MirrorSettings

    st = settings or MirrorSettings.from_env()
    return boto3.session.Session().client(
        "s3", config=Config(max_pool_connections=32, connect_timeout=st.connect_timeout,
                            read_timeout=st.read_timeout, retries={"mode": "standard", "max_attempts": st.attempts}))


def error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code", ""))
    return ""


def call(what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs), with botocore's errors turned into one CheckpointError line."""
    from boto3.exceptions import Boto3Error
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return fn(*args, **kwargs)
    except ClientError as exc:
        err = exc.response.get("Error", {})
        raise CheckpointError(f"{what}: {err.get('Code', '?')} ({err.get('Message', '')})") from exc
    except (BotoCoreError, Boto3Error) as exc:  # Boto3Error: the transfer manager's S3UploadFailedError
        raise CheckpointError(f"{what}: {exc} (check AWS_ENDPOINT_URL and the credentials)") from exc


def point(label: str, where: str = "") -> None:
    """The crash-test seam (a no-op in production)."""
    from ..checkpoint.fsio import fault_point

    fault_point(f"mirror.{label}", where)


def get_bounded(s3: Any, loc: S3Location, key: str, limit: int) -> bytes | None:
    """The object's bytes, or None when it does not exist; refuses objects over `limit`."""
    got = get_with_metadata(s3, loc, key, limit)
    return None if got is None else got[0]


def get_with_metadata(s3: Any, loc: S3Location, key: str, limit: int) -> tuple[bytes, dict[str, str]] | None:
    """(bytes, user metadata) of the object, or None when it does not exist; refuses objects
    over `limit`."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        obj = s3.get_object(Bucket=loc.bucket, Key=key)
    except ClientError as exc:
        if error_code(exc) in ("NoSuchKey", "404", "NotFound"):
            return None
        raise CheckpointError(f"reading s3://{loc.bucket}/{key}: {error_code(exc)}") from exc
    except BotoCoreError as exc:
        raise CheckpointError(f"reading s3://{loc.bucket}/{key}: {exc}") from exc
    if int(obj.get("ContentLength", 0)) > limit:
        obj["Body"].close()
        raise UnreadableCheckpointError(f"s3://{loc.bucket}/{key} is {obj['ContentLength']} bytes, over this "
                                        f"version's read cap of {limit} bytes: unreadable by this version")
    data: bytes = call(f"reading s3://{loc.bucket}/{key}", obj["Body"].read, limit + 1)
    obj["Body"].close()
    return data, dict(obj.get("Metadata") or {})


def head(s3: Any, loc: S3Location, key: str) -> dict[str, Any] | None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        return dict(s3.head_object(Bucket=loc.bucket, Key=key))
    except ClientError as exc:
        if error_code(exc) in ("NoSuchKey", "404", "NotFound"):
            return None
        raise CheckpointError(f"looking up s3://{loc.bucket}/{key}: {error_code(exc)}") from exc
    except BotoCoreError as exc:
        raise CheckpointError(f"looking up s3://{loc.bucket}/{key}: {exc}") from exc


def list_objects(s3: Any, loc: S3Location, prefix: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
    """Pages of list_objects_v2 under `prefix` (each page a dict with Contents/CommonPrefixes)."""
    kwargs: dict[str, Any] = {"Bucket": loc.bucket, "Prefix": prefix}
    if delimiter:
        kwargs["Delimiter"] = delimiter
    pages = s3.get_paginator("list_objects_v2").paginate(**kwargs)
    yield from call(f"listing {loc.url}", lambda: list(pages))


def abort_uploads(s3: Any, loc: S3Location, prefix: str) -> int:
    """Abort unfinished multipart uploads under `prefix` (left by a killed uploader)."""
    res = call(f"listing multipart uploads under s3://{loc.bucket}/{prefix}", s3.list_multipart_uploads,
               Bucket=loc.bucket, Prefix=prefix)
    n = 0
    for up in res.get("Uploads") or []:
        call(f"aborting the multipart upload of s3://{loc.bucket}/{up['Key']}", s3.abort_multipart_upload,
             Bucket=loc.bucket, Key=up["Key"], UploadId=up["UploadId"])
        n += 1
    return n


def get_range(s3: Any, loc: S3Location, key: str, start: int, end: int) -> bytes:
    obj = call(f"reading s3://{loc.bucket}/{key}", s3.get_object, Bucket=loc.bucket, Key=key,
               Range=f"bytes={start}-{end - 1}")
    body = obj["Body"]
    try:
        data: bytes = body.read(end - start + 1)
    finally:
        body.close()
    if len(data) != end - start:
        raise CorruptCheckpointError(f"s3://{loc.bucket}/{key} ended at byte {start + len(data)}, "
                                     f"the manifest says more")
    return data

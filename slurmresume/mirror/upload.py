"""A step's files into the bucket: many parts in flight, read with `pread`, memory bounded.

`plan_upload` (pure) picks the part size from the largest file's size (8 MiB, more only where
S3's 10,000 parts per object demand it) and the parts in flight from a memory bound: parts in
flight x part size <= `memory` (SLURMRESUME_MIRROR_UPLOAD_MIB), at most MAX_IN_FLIGHT, at
least one. That product is all the file bytes an upload holds at once: each worker reads its
part (`os.pread`, one copy out of the page cache) only when it starts sending it.

`upload_files` runs every request of the files on one pool of that many threads: a file no
larger than a part is one PUT, a larger one a multipart upload whose parts and completion are
queued as soon as its creation answers. Small files (index, manifest) go out beside the
shards' parts instead of after them. On any failure the other requests stop, the multipart
uploads this call started are aborted (best effort), and one CheckpointError is raised.
Requests are retried by botocore (`settings.attempts`, standard mode: a bytes body can be
sent again).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError, CorruptCheckpointError
from ..storage.s3 import S3Location, call, point

log = logging.getLogger("slurmresume")

MIB = 1 << 20
MIN_PART = 8 * MIB  # boto3's transfer manager's part size: below it, each request's own cost shows
S3_MIN_PART = 5 * MIB  # S3 refuses smaller parts (but the last)
S3_MAX_PARTS = 10_000  # S3's limit of parts per object
MAX_IN_FLIGHT = 10  # boto3's default concurrency; more only adds threads on a shared node
UPLOAD_MIB = 128  # default memory bound: 10 parts of 8 MiB, 8 of 16 MiB, ...


@dataclass(frozen=True)
class UploadPlan:
    part: int  # bytes per part; a file of at most this many bytes is one PUT
    in_flight: int  # parts (requests) in flight at once

    @property
    def memory(self) -> int:
        """The most file bytes the upload holds at once."""
        return self.part * self.in_flight


def plan_upload(largest: int, memory: int = UPLOAD_MIB * MIB, *, part: int | None = None,
                in_flight: int | None = None) -> UploadPlan:
    """Part size and parts in flight for files of at most `largest` bytes, within `memory`
    bytes (parts in flight x part size <= memory, but at least one part). `part`/`in_flight`
    override the choice (a part never below S3's 5 MiB minimum)."""
    if part is None:
        need = -(-largest // S3_MAX_PARTS)  # S3 takes at most 10,000 parts per object
        part = max(MIN_PART, -(-need // MIB) * MIB)
    part = max(S3_MIN_PART, part)
    if in_flight is None:
        in_flight = min(MAX_IN_FLIGHT, memory // part)
    return UploadPlan(part, max(1, in_flight))


@dataclass(frozen=True)
class Item:
    """One object to write: `size` bytes of the open file `fd`, or `data` when it is None."""

    key: str
    size: int
    fd: int | None = None
    data: bytes | None = None
    what: str = ""  # the local file, for messages


def upload_files(s3: Any, loc: S3Location, items: list[Item], plan: UploadPlan) -> None:
    """Write every item to its key (who: rank 0's uploader). Returns when all are stored;
    raises CheckpointError (CorruptCheckpointError: a file shorter than its size) otherwise,
    after the requests in flight ended and the multipart uploads started here were aborted."""
    started: dict[str, str] = {}  # key -> UploadId of the multipart uploads not yet completed
    with ThreadPoolExecutor(max_workers=plan.in_flight, thread_name_prefix="slurmresume-put") as pool:
        running: dict[Future[Any], tuple[str, Item, int]] = {}

        def submit(kind: str, it: Item, n: int, fn: Callable[..., Any], *args: Any) -> None:
            running[pool.submit(fn, *args)] = (kind, it, n)

        for it in items:
            if it.size > plan.part:
                submit("create", it, 0, _create, s3, loc, it)
            else:
                submit("put", it, 0, _put, s3, loc, it)
        etags: dict[str, dict[int, str]] = {}
        try:
            while running:
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for fut in done:
                    kind, it, n = running.pop(fut)
                    got = fut.result()
                    if kind == "create":
                        started[it.key], etags[it.key] = got, {}
                        for i, off in enumerate(range(0, it.size, plan.part), start=1):
                            submit("part", it, i, _part, s3, loc, it, got, i, off, min(plan.part, it.size - off))
                    elif kind == "part":
                        etags[it.key][n] = got
                        if len(etags[it.key]) * plan.part >= it.size:
                            submit("complete", it, 0, _complete, s3, loc, it, started[it.key], etags[it.key])
                    elif kind == "complete":
                        del started[it.key]
        except BaseException:
            _stop(running, started)
            _abort(s3, loc, started)
            raise


def _stop(running: dict[Future[Any], tuple[str, Item, int]], started: dict[str, str]) -> None:
    """Cancel the waiting requests, wait for the running ones (bounded by botocore's timeouts and
    tries), and note the multipart uploads they started or completed meanwhile in `started`."""
    for fut in running:
        fut.cancel()
    wait(list(running))
    for fut, (kind, it, _) in running.items():
        if fut.cancelled() or fut.exception() is not None:
            continue
        if kind == "create":
            started[it.key] = fut.result()
        elif kind == "complete":
            started.pop(it.key, None)


def _read(it: Item, off: int, n: int) -> bytes:
    assert it.fd is not None
    chunks, want = [], n
    while want:
        try:
            got = os.pread(it.fd, want, off + n - want)
        except OSError as exc:
            raise CheckpointError(f"reading {it.what} for upload at byte {off + n - want}: {exc}") from exc
        if not got:
            raise CorruptCheckpointError(f"{it.what} is shorter than its manifest says ({it.size} bytes): "
                                         "changed while being uploaded")
        chunks.append(got)
        want -= len(got)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _put(s3: Any, loc: S3Location, it: Item) -> None:
    point("shard" if it.fd is not None else "manifest", it.key)
    body = it.data if it.data is not None else _read(it, 0, it.size)
    call(f"uploading {it.what} to s3://{loc.bucket}/{it.key}", s3.put_object, Bucket=loc.bucket, Key=it.key,
         Body=body)


def _create(s3: Any, loc: S3Location, it: Item) -> str:
    point("shard", it.key)
    res = call(f"starting the upload of {it.what} to s3://{loc.bucket}/{it.key}", s3.create_multipart_upload,
               Bucket=loc.bucket, Key=it.key)
    return str(res["UploadId"])


def _part(s3: Any, loc: S3Location, it: Item, upload_id: str, n: int, off: int, size: int) -> str:
    point("part", it.key)
    res = call(f"uploading part {n} of {it.what} to s3://{loc.bucket}/{it.key}", s3.upload_part,
               Bucket=loc.bucket, Key=it.key, UploadId=upload_id, PartNumber=n, Body=_read(it, off, size))
    return str(res["ETag"])


def _complete(s3: Any, loc: S3Location, it: Item, upload_id: str, etags: dict[int, str]) -> None:
    parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
    call(f"completing the upload of {it.what} to s3://{loc.bucket}/{it.key}", s3.complete_multipart_upload,
         Bucket=loc.bucket, Key=it.key, UploadId=upload_id, MultipartUpload={"Parts": parts})


def _abort(s3: Any, loc: S3Location, started: dict[str, str]) -> None:
    """Abort what a failed upload started; what stays (server down) is the leftovers' rule's."""
    for key, upload_id in started.items():
        try:
            call(f"aborting the upload of s3://{loc.bucket}/{key}", s3.abort_multipart_upload, Bucket=loc.bucket,
                 Key=key, UploadId=upload_id)
        except CheckpointError as exc:
            log.warning("mirror: %s", exc)

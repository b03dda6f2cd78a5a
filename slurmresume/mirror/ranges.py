"""One ranged GET of a shard that survives a cut connection, a stall or a 5xx: each try asks
for the bytes not yet written (`Range: bytes=OFF-END`), after a pause that doubles, at most
`settings.attempts` tries and never past the deadline. A try never waits longer than the
client's read timeout for a byte, so a server that accepts and never answers costs at most
attempts x (timeouts + pauses), and the deadline caps even that.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from ..errors import CheckpointError
from ..storage.s3 import S3Location, error_code
from ..storage.settings import MirrorSettings

log = logging.getLogger("slurmresume")

BUFFER = 1 << 20


class _Cut(Exception):
    """The body ended before the range did (a connection closed mid-part)."""


def fetch_range(s3: Any, loc: S3Location, key: str, fd: int, start: int, end: int, settings: MirrorSettings,
                deadline: float | None) -> None:
    """Write bytes [start, end) of the object `key` into `fd` at the same offsets. Raises one
    CheckpointError line naming the object and the tries once they are spent (or the deadline)."""
    from botocore.exceptions import BotoCoreError, ClientError

    done, tries = [start], 0  # done[0]: the first byte not yet written
    while done[0] < end:
        if deadline is not None and time.monotonic() > deadline:
            raise CheckpointError(f"downloading s3://{loc.bucket}/{key}: over the deadline at byte {done[0]} "
                                  f"of {end}")
        tries += 1
        try:
            _read(s3, loc, key, fd, done, end)
        except (BotoCoreError, ClientError, _Cut, ConnectionError, TimeoutError) as exc:
            if isinstance(exc, ClientError) and not _retryable(exc):
                raise CheckpointError(f"downloading s3://{loc.bucket}/{key}: {error_code(exc)}") from exc
            pause = settings.pause(tries)
            why = str(exc) or type(exc).__name__
            if tries >= settings.attempts or (deadline is not None and time.monotonic() + pause > deadline):
                raise CheckpointError(f"downloading s3://{loc.bucket}/{key} at byte {done[0]} of {end}: {why} "
                                      f"(after {tries} tries)") from exc
            log.warning("mirror: s3://%s/%s cut at byte %d of %d (%s): try %d of %d in %.1f s", loc.bucket, key,
                        done[0], end, why, tries + 1, settings.attempts, pause)
            time.sleep(pause)


def _retryable(exc: Any) -> bool:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    return int(status) >= 500 or error_code(exc) in ("SlowDown", "RequestTimeout", "Throttling")


def _read(s3: Any, loc: S3Location, key: str, fd: int, done: list[int], end: int) -> None:
    """One try: GET bytes [done[0], end) into fd, advancing done[0] past every byte written,
    so that a cut leaves it where the next try starts."""
    obj = s3.get_object(Bucket=loc.bucket, Key=key, Range=f"bytes={done[0]}-{end - 1}")
    body = obj["Body"]
    try:
        while done[0] < end:
            data = body.read(min(BUFFER, end - done[0]))
            if not data:
                raise _Cut(f"the body ended at byte {done[0]}")
            _pwrite_all(fd, data, done[0])
            done[0] += len(data)
    finally:
        body.close()


def _pwrite_all(fd: int, data: bytes, off: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, off)
        view, off = view[n:], off + n

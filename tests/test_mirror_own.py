"""A run's own abandoned upload attempts (mirror/own.py), decided against an in-process bucket:
removed once the bucket answers, never when the step's marker names them, kept while it does
not answer. (The real server, SIGKILLed mid-upload: test_mirror_server_crash.py.)"""

from __future__ import annotations

from typing import Any

import pytest
from botocore.exceptions import EndpointConnectionError

from slurmresume.errors import CheckpointError
from slurmresume.mirror import S3Location
from slurmresume.mirror.own import OwnAttempts
from slurmresume.storage.bucketcommit import OBJECTS_META

LOC = S3Location("bkt", "run")
MINE, OTHER = "attempt-" + "1" * 32, "attempt-" + "2" * 32


class Bucket:
    """The few S3 calls own.py makes, on dicts; `down` makes every call fail as a dead server's."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, str]] = {}  # key -> metadata
        self.uploads: dict[str, str] = {}  # upload id -> key
        self.down = False

    def _answer(self) -> None:
        if self.down:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:1")

    def head_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        from botocore.exceptions import ClientError

        self._answer()
        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "404"}}, "HeadObject")
        return {"Metadata": self.objects[Key]}

    def list_multipart_uploads(self, Bucket: str, Prefix: str) -> dict[str, Any]:
        self._answer()
        return {"Uploads": [{"Key": k, "UploadId": u} for u, k in self.uploads.items() if k.startswith(Prefix)]}

    def abort_multipart_upload(self, Bucket: str, Key: str, UploadId: str) -> None:
        self._answer()
        del self.uploads[UploadId]

    def delete_objects(self, Bucket: str, Delete: dict[str, Any]) -> None:
        self._answer()
        for o in Delete["Objects"]:
            self.objects.pop(o["Key"], None)

    def get_paginator(self, name: str) -> Any:
        bucket = self

        class Pages:
            def paginate(self, Bucket: str, Prefix: str) -> Any:
                bucket._answer()
                return [{"Contents": [{"Key": k} for k in bucket.objects if k.startswith(Prefix)]}]

        return Pages()


def attempt_left(bucket: Bucket, step: int, folder: str) -> None:
    """What a killed upload of `folder` leaves: its manifest and an unfinished shard upload."""
    bucket.objects[LOC.key(step, f"{folder}/manifest.json")] = {}
    bucket.uploads[f"u-{folder}-{step}"] = LOC.key(step, f"{folder}/rank-00000-of-00001.safetensors")


def test_an_abandoned_attempt_is_removed_and_a_strangers_is_not() -> None:
    bucket, own = Bucket(), OwnAttempts()
    attempt_left(bucket, 20, MINE)
    attempt_left(bucket, 20, OTHER)  # another writer's, live
    own.started(20, MINE)
    own.abandoned(20, MINE)
    assert own.clean(bucket, LOC) == 2
    assert set(bucket.uploads) == {f"u-{OTHER}-20"}
    assert set(bucket.objects) == {LOC.key(20, f"{OTHER}/manifest.json")}
    assert own.pending() == []


def test_a_running_or_committed_attempt_is_never_touched() -> None:
    bucket, own = Bucket(), OwnAttempts()
    attempt_left(bucket, 20, MINE)
    attempt_left(bucket, 30, MINE)
    own.started(20, MINE)  # still uploading
    own.started(30, MINE)
    own.committed(30, MINE)
    assert own.clean(bucket, LOC) == 0 and len(bucket.uploads) == 2 and len(bucket.objects) == 2


def test_an_attempt_the_marker_names_is_a_commit_and_stays() -> None:
    """The marker write failed on the way back, but the server stored it: the step is committed
    with this attempt's objects, which are then kept."""
    bucket, own = Bucket(), OwnAttempts()
    bucket.objects[LOC.key(20, f"{MINE}/manifest.json")] = {}
    bucket.objects[LOC.key(20, "COMMITTED")] = {OBJECTS_META: MINE}
    own.abandoned(20, MINE)
    assert own.clean(bucket, LOC) == 0
    assert len(bucket.objects) == 2 and own.pending() == []


def test_while_the_bucket_does_not_answer_the_attempt_stays_for_the_next_try() -> None:
    bucket, own = Bucket(), OwnAttempts()
    attempt_left(bucket, 20, MINE)
    own.abandoned(20, MINE)
    bucket.down = True
    with pytest.raises(CheckpointError):
        own.clean(bucket, LOC)
    assert len(own.pending()) == 1
    bucket.down = False  # the server is back
    assert own.clean(bucket, LOC) == 2 and not bucket.uploads and not bucket.objects and own.pending() == []


def test_close_removes_what_is_left_when_the_bucket_answered_the_last_job(monkeypatch) -> None:
    from slurmresume.mirror import Mirror

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")  # never asked: the fake bucket answers
    mirror = Mirror(LOC)
    mirror.s3 = bucket = Bucket()
    attempt_left(bucket, 20, MINE)
    mirror.own.abandoned(20, MINE)
    assert mirror.close() is True
    assert not bucket.uploads and not bucket.objects and mirror.own.pending() == []


def test_close_after_a_failed_last_job_removes_them_when_the_bucket_answers_again(monkeypatch) -> None:
    from slurmresume.mirror import Mirror

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    mirror = Mirror(LOC)
    mirror.s3 = bucket = Bucket()
    attempt_left(bucket, 20, MINE)
    mirror.own.abandoned(20, MINE)
    mirror._failed = (20, "the server did not answer")  # what the uploader records after its last try
    assert mirror.close() is False  # step 20 is behind: the next run uploads it
    assert not bucket.uploads and not bucket.objects and mirror.own.pending() == []


def test_close_keeps_its_deadline_while_the_bucket_hangs(monkeypatch, caplog) -> None:
    import threading

    from slurmresume.mirror import Mirror

    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("SLURMRESUME_MIRROR_CLOSE_DEADLINE", "0.5")
    mirror = Mirror(LOC)
    mirror.s3 = bucket = Bucket()
    attempt_left(bucket, 20, MINE)
    mirror.own.abandoned(20, MINE)
    answer = threading.Event()
    real_head = bucket.head_object

    def head_object(**kwargs: Any) -> Any:
        answer.wait()  # no answer until the test says so (after close() returned)
        return real_head(**kwargs)

    bucket.head_object = head_object  # type: ignore[method-assign]
    closed: list[bool] = []
    try:
        closing = threading.Thread(target=lambda: closed.append(mirror.close()), daemon=True)
        closing.start()
        closing.join(120)  # a hang guard only: close() returns after its 0.5 s deadline
        assert closed == [True], "close() waited on a bucket that does not answer"
        assert len(bucket.uploads) == 1 and len(mirror.own.pending()) == 1
        assert "1 upload attempt(s) of this run stay unfinished" in caplog.text
    finally:
        answer.set()

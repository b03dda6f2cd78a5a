"""One exception hierarchy. Every message names the thing, the bad value and the fix."""

from __future__ import annotations

__all__ = [
    "SlurmResumeError",
    "ConfigError",
    "CheckpointError",
    "CorruptCheckpointError",
    "PeerReadError",
    "UnsafeCheckpointError",
    "UnreadableCheckpointError",
    "NotPermittedError",
    "SaveError",
    "NoCheckpointError",
    "SlurmError",
    "RankFailedError",
]


class SlurmResumeError(Exception):
    """Base class: the CLI turns any of these into one line on stderr and exit code 1."""


class ConfigError(SlurmResumeError, ValueError):
    """A user-supplied value is invalid (option, path, state object)."""


class CheckpointError(SlurmResumeError):
    """A checkpoint could not be read or written."""


class CorruptCheckpointError(CheckpointError):
    """A committed checkpoint fails its size or checksum check."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint tries to make us read outside its directory or allocate without bound."""


class PeerReadError(CorruptCheckpointError):
    """A resharding restore's exchange: the rank that reads a saved shard for this one could not
    read it (that rank's own error says why, and is the one reported)."""


class UnreadableCheckpointError(CheckpointError):
    """A committed checkpoint this version cannot read: written by a newer slurmresume (a newer
    manifest format) or over one of this version's read caps, or one this user may not read
    (`NotPermittedError`). Not corrupt (deliberately not a CorruptCheckpointError): it is never
    deleted, replaced or skipped for an older step."""


class NotPermittedError(UnreadableCheckpointError):
    """A step's directory or file that this user may not read (permission denied: another user's
    run with a strict umask under a shared root). `path`: what could not be read."""

    def __init__(self, message: str, path: object = None) -> None:
        super().__init__(message)
        self.path = path


class SaveError(CheckpointError):
    """A save failed; no commit marker was written and the previous checkpoint is intact."""


class NoCheckpointError(CheckpointError):
    """No complete checkpoint exists where one was required."""


class SlurmError(SlurmResumeError):
    """A Slurm command failed or is missing."""


class RankFailedError(SlurmResumeError):
    """An unexpected exception (a bug: slurmresume's, or in a state object's methods) on one rank
    during a collective call, raised on every rank so that none is left waiting in a collective.
    The message names the rank, the exception's type and its message; that rank logs the
    traceback (and chains the original exception)."""

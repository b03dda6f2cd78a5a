"""The contract of a storage root (see slurmresume/storage/__init__.py): what every tier
answers, and the one verify record."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..checkpoint.store import CheckpointInfo

if TYPE_CHECKING:
    from ..checkpoint.manifest import Manifest
    from ..retention import CheckpointRecord, PrunePlan, PruneResult, RetentionPolicy

Progress = Callable[[int, int], None]


@dataclass
class VerifyResult:
    step: int
    path: str  # the step directory, or the step's URL on a bucket
    ok: bool
    problems: list[str]
    unreadable: bool = False  # not checked: this version cannot read it (newer format, over a cap); not corrupt


class Root(Protocol):
    """A checkpoint root (see the module docstring)."""

    url: str
    directory: Path | None

    def steps(self) -> list[int]: ...

    def inspect(self, step: int, *, verify: bool = False, scan: bool = False, sizes: bool = True) -> CheckpointInfo: ...

    def infos(self, *, verify: bool = False, scan: bool = False) -> list[CheckpointInfo]: ...

    def latest(self, *, verify: bool = False, exclude: Collection[int] = (), max_step: int | None = None,
               scan: bool = False, sizes: bool = True, warn: bool = False,
               skipped: Callable[[CheckpointInfo], None] | None = None) -> CheckpointInfo | None: ...

    def read_marker(self, step: int) -> bytes: ...

    def read_manifest(self, step: int) -> Manifest: ...

    def open_range(self, step: int, name: str, offset: int, length: int) -> bytes: ...

    def verify(self, step: int | None = None, every: bool = False,
               progress: Progress | None = None) -> list[VerifyResult]: ...

    def records(self) -> list[CheckpointRecord]: ...

    def plan(self, records: Iterable[CheckpointRecord], policy: RetentionPolicy, now: float) -> PrunePlan: ...

    def leftovers(self) -> list[str]: ...

    def prune(self, policy: RetentionPolicy, approved: Collection[str] | None = None, *,
              progress: Progress | None = None) -> PruneResult: ...

    def delete(self, step: int) -> None: ...

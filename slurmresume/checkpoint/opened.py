"""The shard files of one restore on one rank, each opened and its header checked once.

A restore's plan opens this rank's shard (and shard 0 for the replicated tensors) to read and
check the header; its read then reads tensor bytes from the same files. Opening each again cost
one metadata operation per file per pass against the shared file system's metadata server, and a
header parse each time. `OpenShards` keeps each file's fd (opened by `shardread.open_checked`, so
never a symbolic link and of the size the manifest records) with its checked header from the
plan to the last read: the bytes read are those of the very file whose header was checked.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any

from . import mapped
from .shardread import Expected, check_name, check_span, open_read, read_header, split_locator


class OpenShards:
    """Every rank, for one restore: `get(file, ...)` opens a shard file (a locator: a node file's
    range is its own entry, and the node file is opened once for all its ranges) and reads its
    header on first use, then hands back the same
    (fd, header, data start). `close()` when the restore is done with the files (idempotent);
    a dropped object closes its fds too. `maps`: where the restore reads through mappings
    (`mapped.reading_mapped`, the memory tier), the readers' mappings of these files, else None."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._files: dict[str, tuple[int, dict[str, Any], int]] = {}
        self._node_files: dict[str, int] = {}  # a node file's name -> its one fd, shared by its ranges
        self.maps = mapped.Mappings() if mapped.wanted() else None
        self._closer = weakref.finalize(self, _close_all, self._files, self._node_files, self.maps)

    def get(self, file: str, expected_bytes: int, expect: Expected | None = None) -> tuple[int, dict[str, Any], int]:
        """(fd, header, data start) of `file`; its header checked against `expect` when it is
        first opened (CorruptCheckpointError / UnsafeCheckpointError as `read_header`)."""
        got = self._files.get(file)
        if got is None:
            name, base = split_locator(file)
            fd = self._node_files.get(name) if base is not None else None
            if fd is None:
                fd, header, start, _ = open_read(self.directory, file, expected_bytes, expect)
                if base is not None:
                    self._node_files[name] = fd
            else:  # another rank's range of a node file this restore has open: no second open
                check_name(self.directory, file)
                check_span(self.directory, file, expected_bytes, os.fstat(fd).st_size)
                header, start = read_header(self.directory, file, expected_bytes, expect, fd=fd)
            got = self._files[file] = (fd, header, start)
        return got

    def header(self, file: str, expected_bytes: int, expect: Expected | None = None) -> dict[str, Any]:
        return self.get(file, expected_bytes, expect)[1]

    def close(self) -> None:
        _close_all(self._files, self._node_files, self.maps)  # the finalizer stays armed: it closes what comes after


def _close_all(files: dict[str, tuple[int, dict[str, Any], int]], node_files: dict[str, int],
               maps: mapped.Mappings | None = None) -> None:
    if maps is not None:  # before the fds (a mapping outlives its fd, but is ours to drop)
        maps.close()
    for fd in {fd for fd, _, _ in files.values()} | set(node_files.values()):  # a node file's fd once
        try:
            os.close(fd)
        except OSError:
            pass
    files.clear()
    node_files.clear()

"""`verify`: recompute the shard checksums of one, the newest or every committed step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.store import (
    UNREADABLE,
    CheckpointInfo,
    check_checksums,
    inspect_dir,
    list_checkpoints,
)
from ..errors import ConfigError


@dataclass
class VerifyResult:
    step: int
    path: str
    ok: bool
    problems: list[str]
    unreadable: bool = False  # not checked: this version cannot read it (newer format, over a cap); not corrupt


def verify_checkpoints(root: Path, step: int | None = None, every: bool = False,
                       progress: Callable[[int, int], None] | None = None) -> list[VerifyResult]:
    """Recompute shard checksums: of `step`, of every marked directory (`every`), or of the
    newest complete one. Each problem names the bad file. Raises NoCheckpointError /
    ConfigError when there is nothing to verify."""
    from ..checkpoint.layout import step_dir_name
    from ..checkpoint.store import find_latest
    from ..errors import NoCheckpointError

    root = Path(root)
    if not root.is_dir():
        raise ConfigError(f"checkpoint root {root} does not exist: pass --ckpt-dir or set SLURMRESUME_CKPT_DIR")
    if every:
        infos = [i for i in list_checkpoints(root) if i.has_marker or i.unreadable
                 or (i.problem or "").startswith(UNREADABLE)]
    elif step is not None:
        infos = [inspect_dir(step, root / step_dir_name(step))]
        if not infos[0].path.is_dir():
            raise NoCheckpointError(f"no step {step} under {root}: `slurmresume status --ckpt-dir {root}` lists them")
        if not infos[0].has_marker:
            raise NoCheckpointError(f"step {step} under {root} is incomplete (no commit marker): nothing to verify")
    else:
        latest = find_latest(root, warn=False)
        infos = [latest] if latest is not None else []
    if not infos:
        raise NoCheckpointError(f"no complete checkpoint under {root} to verify")
    out = []
    for done, info in enumerate(infos, 1):
        out.append(_verify_one(info))
        if progress is not None:
            progress(done, len(infos))
    return out


def _verify_one(info: CheckpointInfo) -> VerifyResult:
    if info.manifest is None:
        return VerifyResult(info.step, str(info.path), False,
                            [f"{info.path.name}: {info.problem or 'unreadable manifest'}"], unreadable=info.unreadable)
    problems = check_checksums(info.path, info.manifest)
    return VerifyResult(info.step, str(info.path), not problems, problems)

"""Which checkpoint root a `Checkpointer` uses, and that its run alone writes there.

`resolve_root` is local; `claim_root` is collective (rank 0 takes the lease, every rank learns
the answer); `warn_if_not_launchers_root` runs on every rank and speaks on rank 0.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from ..checkpoint.collective import Group
from ..checkpoint.layout import enclosing_step_dir
from ..contract import ENV_OWNER
from ..contract import ENV_ROOT as ENV_ROOT  # re-exported (train.checkpointer.ENV_ROOT)
from ..errors import ConfigError
from ..events import EV_ROOT_CONFLICT, append_event

log = logging.getLogger("slurmresume")


def resolve_root(root: str | os.PathLike[str] | None) -> Path:
    """The checkpoint root: the argument, else $SLURMRESUME_CKPT_DIR. Refuses a file."""
    value = root if root is not None else os.environ.get(ENV_ROOT)
    if value is None or str(value) == "":
        raise ConfigError(f"no checkpoint root: pass Checkpointer(root=...) or set {ENV_ROOT}")
    from ..mirror.hook import refuse_bucket_root

    refuse_bucket_root(value, "mirror=")  # not a local folder named "s3:"
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"checkpoint root {path} is a file, not a directory: choose a directory path")
    step = enclosing_step_dir(path)
    if step is not None:  # `latest` prints one; saving there would write step folders into a checkpoint
        given = "Checkpointer(root=...)" if root is not None else ENV_ROOT
        where = "" if step == path.absolute() else "inside "
        raise ConfigError(f"{given} {path} is {where}the step folder {step}, a saved checkpoint of checkpoint root "
                          f"{step.parent}: give that root instead ({ENV_ROOT}={step.parent})")
    return path


def claim_root(group: Group, root: Path, held: tuple[str, str] | None = None, *,
               saving: bool = False) -> tuple[str, str] | None:
    """Collective. Rank 0 takes or checks the root's lease (ownership.py) and returns its key
    (None on other ranks); a refusal is raised on every rank as RootOwnedError (no rank is left
    waiting in a collective). `saving`: before a save (`claims.before_save`: the lease this
    run holds, `held`, must still be its own; a root this save creates is leased now)."""
    from ..ownership import RootOwnedError
    from .claims import before_save, for_checkpointer

    key, error = None, None
    if group.rank == 0:
        try:
            key = before_save(root, held) if saving else for_checkpointer(root)
        except RootOwnedError as exc:
            error = str(exc)
        if saving and error is None:  # the owner, before it writes: free what killed writers left
            _clean_leftovers(root)
        if not saving and error is None and (key is not None or os.environ.get(ENV_OWNER)):
            _finish_replaces(root)  # the owner (a lease held), before its restore: a replace a kill cut
    error = group.broadcast_json(error)
    if error:
        raise RootOwnedError(error)
    return key


def _clean_leftovers(root: Path) -> None:
    from ..checkpoint.leftovers import clean
    from ..retention import DEFAULT_YOUNG_THRESHOLD

    try:
        clean(root, DEFAULT_YOUNG_THRESHOLD)
    except Exception as exc:  # noqa: BLE001 - never fails a save
        log.warning("could not clean leftover directories under %s: %s", root, exc)


def _finish_replaces(root: Path) -> None:
    from ..checkpoint.replace import finish

    try:
        finish(root)
    except Exception as exc:  # noqa: BLE001 - never fails the start (finish logs its own failures)
        log.warning("could not settle an interrupted replace under %s: %s", root, exc)


def warn_if_not_launchers_root(explicit: str | os.PathLike[str] | None, root: Path, rank: int) -> None:
    """An explicit root that differs from the launcher's ($SLURMRESUME_CKPT_DIR, set by
    `submit`/`drill`) silently moves every checkpoint where the launcher, `status` and the
    drill do not look: warn loudly naming both, and leave a `root_conflict` event in the
    launcher's root so that the drill can say why it found nothing there."""
    launcher = os.environ.get(ENV_ROOT)
    if explicit is None or not launcher or Path(launcher).expanduser().resolve() == root.resolve():
        return
    if rank == 0:
        log.warning("Checkpointer(root=%s) overrides the launcher's %s=%s: checkpoints go to %s, where the "
                    "launcher (requeue), `slurmresume status` and `slurmresume drill` do not look; pass "
                    "root=None to use the launcher's root", root, ENV_ROOT, launcher, root)
        try:
            append_event(Path(launcher), EV_ROOT_CONFLICT, script_root=str(root), launcher_root=launcher)
        except OSError as exc:
            log.warning("could not record the root conflict under %s: %s", launcher, exc)

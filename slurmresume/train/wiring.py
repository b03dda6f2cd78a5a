"""What a `Checkpointer` sets up when it is created (`wire`) and releases when it closes
(`Wiring.release`).

`wire` runs on every rank, in this order (each arrow one collective when torch.distributed is
initialised; without it, a world of one and no collective):

  1. all: the mirror URL checked (a bad one is a ConfigError on every rank, before any setup);
          the save scheduler built (its clock starts here; "auto" reads the root's event log);
  2. all: the side group for saves and restores (`Group.create`)           -> new_group
          and with SLURMRESUME_LAYOUT=per-node the node's own gloo group (`nodefile.link_for`:
          this process's idle one, else a new one among the node's ranks only)
  3. 0:   the root's lease (`roots.claim_root`)                            -> broadcast; a refusal
          raises on every rank, once the side group is destroyed again;
  4. all: the side group of the step-boundary agreement                    -> new_group
  5. all, locally: rank 0's `Mirror`, the log handler, the heartbeat and the async writer that
          reports on it, the drill plans, the root-conflict warning, the warning-signal flag and
          the `StepBoundary` over it.

`release` is local and runs after the last collective (`Checkpointer.close`, or at exit).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.collective import Group
from ..events import logged_pull_rate, read_events, try_append_event
from .asyncsave import AsyncWriter
from .drillhang import drill_hang_step
from .heartbeat import Beat, beat_from_env, expect_io
from .logs import ensure_handler
from .roots import claim_root, warn_if_not_launchers_root
from .signals import SignalFlag, install_flag
from .verdict import StepBoundary, drill_first_save_from_env, drill_step_from_env

if TYPE_CHECKING:
    from .savepolicy import SaveScheduler


@dataclass
class Wiring:
    """One Checkpointer's parts, as `wire` made them: the Checkpointer takes its attributes from
    here and keeps this for `release`. `mirror` is rank 0's `Mirror` (None elsewhere, or without
    one); `beat` is None when run without the launcher; `drill_hang` and `drill_first_save` are
    this attempt's drill plans (`slurmresume drill --hang`; both drill runs save their first step)."""

    group: Group
    agree_group: Group
    lease_key: tuple[str, str] | None
    sched: SaveScheduler
    mirror: Any
    beat: Beat | None
    writer: AsyncWriter
    drill_hang: int | None
    drill_first_save: bool
    flag: SignalFlag | None
    boundary: StepBoundary

    def release(self) -> None:
        """Local, after the last collective: the previous signal handlers back, the side process
        groups gone, and the root's lease freed if this was the process's last Checkpointer on it."""
        from .claims import unclaim

        if self.flag is not None:
            self.flag.uninstall()
        for g in (self.agree_group, self.group):
            g.destroy()
        key, self.lease_key = self.lease_key, None
        unclaim(key)


def wire(root: Path, explicit_root: str | os.PathLike[str] | None, *, save_every: int | None, save_policy: Any,
         retention: Any, mirror: Any, handle_signals: bool) -> Wiring:
    """Every rank, in the order of the module docstring. `root` is the resolved root,
    `explicit_root` what the script passed (compared with the launcher's). Raises ConfigError
    for a bad mirror and RootOwnedError for a root another run owns, on every rank."""
    from ..checkpoint.nodefile import check_layout, link_for
    from ..contract import ENV_MIRROR
    from ..mirror.hook import mirror_for
    from .savepolicy import scheduler_for

    mirror_for(mirror, rank=-1)  # validates the URL (ConfigError) before any setup
    layout = check_layout(mirror is not None or bool(os.environ.get(ENV_MIRROR)))  # per-node: no mirror
    sched = scheduler_for(save_policy, save_every, root)
    group = Group.create()
    try:  # one owner per root: refused here, before anything is written
        if layout == "per-node":  # its node subgroup, taken here: in the main thread, in every rank's order
            link_for(group)
        lease_key = claim_root(group, root)
    except BaseException:
        group.destroy()
        raise
    agree_group = Group.create()
    rank = group.rank
    rank0_mirror = mirror_for(mirror, rank=rank, retention=retention,
                              on_event=lambda name, **f: try_append_event(root, name, **f))
    ensure_handler()  # the training log shows restored / warning / saved lines without setup
    # the launcher's hang watch (heartbeat.py): one pwrite per step(); None when run bare
    beat = beat_from_env(rank)
    if beat is not None and hasattr(rank0_mirror, "on_pull"):  # a pull's bytes scale its hang budget
        rank0_mirror.on_pull = lambda nbytes: expect_io("pull", nbytes, logged_pull_rate(read_events(root)))
    writer = AsyncWriter(beat, sched)
    drill_hang, drill_first_save = drill_hang_step(rank), drill_first_save_from_env()
    warn_if_not_launchers_root(explicit_root, root, rank)
    flag = install_flag(handle_signals)
    # the warning flag, drill injection and time-based saves, agreed on at each step()
    boundary = StepBoundary(agree_group, flag, drill_step_from_env())
    return Wiring(group, agree_group, lease_key, sched, rank0_mirror, beat, writer, drill_hang, drill_first_save,
                  flag, boundary)

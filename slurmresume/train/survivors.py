"""Who writes the failure-time save, decided purely from what every survivor can read on its node
(no message to or from the dead): `plan` over each rank's published step snapshots and each
survivor's status. DESIGN.md section 10; the shell that acts on the plan is `train.failsave`.

The rules:
- A step `s` is a candidate when some survivor's tensors are at `s`: its last `ckpt.step()` was
  `s` and no optimizer step ran on it since (`clean`).
- `s` is covered when every rank, the dead included, published its small state (RNG, plain
  values, per-rank tensors) at `s`, and the tensors that are not replicated are all among what
  the snapshots carry (`missing` names those that are not).
- The newest covered candidate wins; its writer is the lowest clean survivor at it. Nothing
  covered: refused, with every candidate's missing pieces named. Never two steps in one save.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Status:
    """What one survivor reports once it has frozen: the step of its last `ckpt.step()` and
    whether its tensors are untouched since (no optimizer step ran after it)."""

    rank: int
    boundary: int | None
    clean: bool


@dataclass(frozen=True)
class Snapshot:
    """One rank's published small state at one step: `missing` names per-rank tensors that were
    too large to publish (then no failure save of that step can cover this rank)."""

    rank: int
    step: int
    missing: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """`step` and `writer` when a failure save can be committed; else `refused` says why."""

    step: int | None
    writer: int | None
    refused: tuple[str, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return self.step is not None


def plan(world: int, dead: set[int], statuses: Mapping[int, Status],
         snapshots: Mapping[int, list[Snapshot]], *, replicated_known: bool = True) -> Plan:
    """Pure: the failure save to write (see the module docstring). `statuses`: the survivors that
    reported (a survivor that did not is simply no holder); `snapshots`: rank -> its published
    snapshots (at most the last two steps)."""
    if not replicated_known:
        return Plan(None, None, ("which tensors are replicated is not known yet (no step() completed)",))
    if not dead:
        return Plan(None, None, ("no rank is dead",))
    holders: dict[int, list[int]] = {}
    dirty = []
    for st in statuses.values():
        if st.rank in dead or st.boundary is None:
            continue
        if st.clean:
            holders.setdefault(st.boundary, []).append(st.rank)
        else:
            dirty.append(f"rank {st.rank} ran an optimizer step after step {st.boundary}")
    reasons: list[str] = []
    for step in sorted(holders, reverse=True):
        missing = _missing(world, step, snapshots)
        if not missing:
            return Plan(step, min(holders[step]))
        reasons.append(f"step {step}: {'; '.join(missing)}")
    if not holders:
        reasons.append("no survivor holds the tensors of a step boundary"
                       + (f" ({'; '.join(dirty)})" if dirty else ""))
    return Plan(None, None, tuple(reasons))


def _missing(world: int, step: int, snapshots: Mapping[int, list[Snapshot]]) -> list[str]:
    out = []
    for rank in range(world):
        snap = next((s for s in snapshots.get(rank, ()) if s.step == step), None)
        if snap is None:
            have = sorted(s.step for s in snapshots.get(rank, ()))
            out.append(f"rank {rank}'s RNG and plain values at step {step} (published: {have or 'none'})")
        elif snap.missing:
            out.append(f"rank {rank}'s per-rank tensors {', '.join(snap.missing[:4])}"
                       + (f" and {len(snap.missing) - 4} more" if len(snap.missing) > 4 else "")
                       + " (not replicated, too large to publish)")
    return out

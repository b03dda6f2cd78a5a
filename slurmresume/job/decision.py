"""What a run's end means and what to do about it: `RunResult` (the facts of one torchrun run,
as the launcher saw them) and `decide`, the pure table that turns them into finish / requeue /
retry / stop / give up / hold / behind, with the reason the job prints."""

from __future__ import annotations

from dataclasses import dataclass

from ..contract import Outcome
from .hang import Hang


@dataclass(frozen=True)
class RunResult:
    """How one torchrun run ended, as seen from this node: facts only; `kind` names them."""

    returncode: int
    outcome: Outcome | None  # rank 0's record of what it did about a signal (None: no record)
    latest_before: int | None  # the newest committed step (by its marker) before the run
    latest_after: int | None  # ... and after it
    warned: bool = False  # the warning signal was relayed to this run
    stop: str | None = None  # "cancel" | "time_limit" | "interrupt": a SIGTERM/SIGINT, classified
    hang: Hang | None = None  # the hang watch found ranks stuck; the launcher dumped and killed the run
    ended_at: float | None = None  # time.time() of the first death seen, the hang kill, or torchrun's exit
    # rank 0's record that close() left the last committed step off the mirror (exit 78): (step, why)
    mirror_behind: tuple[int | None, str] | None = None
    # the hang watch's view, for `status` (never for a decision): the furthest step boundary this
    # node's ranks reported, and the ranks that died first with their last step boundary
    last_step: int | None = None
    dead_steps: tuple[tuple[int, int], ...] = ()
    # nodes whose launcher closed its ring connection without a goodbye (job/deathboard.py)
    lost_nodes: tuple[int, ...] = ()

    @property
    def progressed(self) -> bool:
        return self.latest_after is not None and (self.latest_before is None or self.latest_after > self.latest_before)

    @property
    def kind(self) -> str:
        """finished | failed | hung | preempted | terminated | save_failed | warned_without_save |
        time_limit | cancelled | interrupted | mirror_behind (finished locally, the bucket lacks the
        last step)."""
        if self.hang is not None:
            return "hung"
        if self.stop is not None:
            return {"interrupt": "interrupted", "cancel": "cancelled", "time_limit": "time_limit"}[self.stop]
        if self.outcome is not None:
            if not self.outcome.committed:
                return "save_failed"
            return "preempted" if self.outcome.kind == "preempt" else "terminated"
        if self.warned and self.returncode != 0:
            return "save_failed"  # a crash (or a lost record) during the emergency save
        if self.warned and not self.progressed:
            return "warned_without_save"
        if self.returncode != 0 and self.mirror_behind is not None and self.latest_after is not None:
            return "mirror_behind"
        return "finished" if self.returncode == 0 else "failed"

    @property
    def saved_step(self) -> int | None:
        """The step this run's emergency save committed (None: none did)."""
        return self.outcome.step if self.outcome is not None and self.outcome.committed else None

    @property
    def lost_steps(self) -> int | None:
        """Steps the ranks had agreed to save that no complete checkpoint holds (a failed save)."""
        if self.outcome is None or self.outcome.committed:
            return None
        return max(0, self.outcome.step - (self.latest_after or 0))


def decide(result: RunResult, *, first_node: bool, requeues_done: int, max_requeues: int | None,
           failures_done: int, max_failures: int | None, previous_progressed: bool | None, hangs_done: int = 0,
           max_hangs: int = 0, previous_hang: tuple[tuple[int, ...], int] | None = None) -> tuple[str, str]:
    """Pure: what to do after a run. Returns (action, reason); action is one of
    "finish", "requeue", "retry" (restart inside the allocation), "stop" (a clean exit without
    requeue), "give_up" (fail the job), "hold" (the same hang twice: keep the job, held),
    "behind" (training finished and is committed locally, the mirror lacks the last step: end
    with EXIT_MIRROR_BEHIND, no retry: re-running would train nothing; the next run uploads it).

    One rule for every way a run can end elsewhere than at its last step without a user asking it
    to stop (a committed preemption, a failed emergency save, the time limit): requeue and resume
    from the newest complete checkpoint, if there is one. A user's stop (scancel, SIGTERM, Ctrl-C)
    is never undone by a requeue."""
    kind = result.kind
    if kind == "hung":
        return _decide_hang(result, hangs_done, max_hangs, previous_hang)
    if kind == "finished":
        if result.latest_after is None:
            return "finish", "training finished, but no checkpoint was ever committed (no ckpt.step()/save() call?)"
        return "finish", "training finished"
    if kind == "mirror_behind":
        assert result.mirror_behind is not None
        step, why = result.mirror_behind
        what = f"step {step}" if step is not None else "the newest step"
        return "behind", (f"training finished at step {result.latest_after}, committed locally, but {what} is not "
                          f"on the mirror ({why}); not retrying: the next run with this mirror uploads it")
    if kind in ("cancelled", "terminated", "interrupted"):
        what = {"cancelled": "cancelled (SIGTERM, not the time limit)", "terminated": "terminated (SIGTERM)",
                "interrupted": "interrupted (SIGINT)"}[kind]
        saved = f"saved step {result.saved_step}" if result.saved_step is not None else "no new save"
        return "stop", f"{what}; {saved}; not requeueing"
    if kind == "warned_without_save":
        return "give_up", ("the warning signal reached the script but it saved nothing (no ckpt.step() "
                           "after it?): this run's work since the last checkpoint is lost")
    if kind == "failed" and not result.lost_nodes:
        return _decide_failure(result, failures_done, max_failures, previous_progressed)
    if kind == "failed":
        # a node whose launcher is gone with its ranks cannot rendezvous again in this allocation:
        # requeue (by the first node, or by every survivor when the first node is the one lost) and
        # resume from the newest committed step, the survivors' failure save when it committed
        why = f"node {', '.join(map(str, result.lost_nodes))} lost (its launcher is gone with its ranks)"
        requeuer = first_node or 0 in result.lost_nodes
    else:
        why, requeuer = _why(result), first_node
    if not requeuer:
        return "stop", f"{why}: the first node requeues the job"
    if result.latest_after is None:
        return "give_up", f"{why}, and there is no complete checkpoint to resume from"
    if max_requeues is not None and requeues_done >= max_requeues:
        return "give_up", f"{why}; after {requeues_done} requeues: --max-requeues {max_requeues} reached"
    if not result.progressed and previous_progressed is False:
        return "give_up", ("crash loop: no new committed step in two consecutive runs "
                           f"(newest is still {result.latest_after})")
    return "requeue", why


def _decide_failure(result: RunResult, failures_done: int, max_failures: int | None,
                    previous_progressed: bool | None) -> tuple[str, str]:
    """A run that failed without a warning (a rank crashed or was killed: an OOM kill, a GPU fault).
    `max_failures` None (the default): carry on from the newest committed step (the survivors'
    failure save, train/failsave.py, when it committed) while runs commit progress; two failed
    runs in a row with no new committed step stop the job (the crash-loop rule). An explicit
    cap: at most that many retries; 0: never retry."""
    failed = f"workers failed (exit {result.returncode})"
    fix = "the script's error is above; fix it and run the same command (it resumes from the newest checkpoint)"
    if max_failures == 0:  # no retry was asked for: say what to do, not that a budget of 0 ran out
        return "give_up", f"{failed}: {fix}"
    source = ("the start (no complete checkpoint yet)" if result.latest_after is None else
              f"the newest complete checkpoint (step {result.latest_after})")
    if max_failures is None:
        if not result.progressed and previous_progressed is False:
            newest = "none" if result.latest_after is None else f"still step {result.latest_after}"
            return "give_up", (f"{failed}, twice in a row with no new committed step (newest: {newest}): "
                               f"crash loop; {fix}")
        return "retry", f"{failed}; retry {failures_done + 1} in this allocation from {source}"
    if failures_done < max_failures:
        return "retry", f"{failed}; retry {failures_done + 1} of {max_failures} from {source}"
    return "give_up", f"{failed} and --max-failures {max_failures} is used up"


def _decide_hang(result: RunResult, hangs_done: int, max_hangs: int,
                 previous_hang: tuple[tuple[int, ...], int] | None) -> tuple[str, str]:
    hang = result.hang
    assert hang is not None
    what = (f"rank(s) {', '.join(map(str, hang.ranks))} hung in {hang.phase} after step {hang.step} "
            f"(silent {hang.silent_s:.0f} s, budget {hang.budget_s:.0f} s)")
    if previous_hang == hang.key and not result.progressed:
        return "hold", (f"{what}, the same hang as the previous run and no new checkpoint since: restarting "
                        "again would hang again; see the stack dumps (slurmresume status), fix, then release the job")
    if hangs_done < max_hangs:
        source = ("the start (no complete checkpoint yet)" if result.latest_after is None else
                  f"the newest complete checkpoint (step {result.latest_after})")
        return "retry", f"{what}; restart {hangs_done + 1} of {max_hangs} (--max-hangs) in this allocation from {source}"
    return "give_up", f"{what}, and --max-hangs {max_hangs} is used up"


def _why(result: RunResult) -> str:
    if result.kind == "preempted":
        return f"preempted at step {result.saved_step}, committed"
    if result.kind == "time_limit":
        return (f"time limit reached before a new commit; resuming from the newest complete checkpoint "
                f"(step {result.latest_after})")
    err = f" ({result.outcome.error})" if result.outcome is not None and result.outcome.error else ""
    agreed = f" of step {result.outcome.step}" if result.outcome is not None else ""
    lost = f", {result.lost_steps} step(s) lost" if result.lost_steps is not None else ""
    return f"the emergency save{agreed} failed{err}; resuming from step {result.latest_after}{lost}"

"""What the drill checks besides the final checkpoints (issue #28; DESIGN §8: PASS only what was
observed): that every restarted run resumed the step the previous run committed and went on
from the step after it, and that both runs passed the same `metrics=` at every step.

Facts come from the launcher's `run_ended` events (what it read in each run's outcome record), the `restored` events and each rank's step record
(`train/steprecord.py`); the checks themselves are pure functions over them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.jsonenc import dumps
from ..events import EV_RESTORED, EV_RUN_ENDED, EV_STARTED, read_events
from ..train.steprecord import read_records

ADAPT = "see README §Adapt your script"
NEVER_RESTORED = "run {i} (after the save at step {saved}) never restored a checkpoint and started over at step {first}: "
WRONG_RESTORE = "run {i} restored step {restored}, but the run before it had committed step {saved}"
# {next}: the step the uninterrupted run passed to ckpt.step() after {saved}, in the script's own
# units (Lightning's global_step counts every optimizer step: 2 per batch with two optimizers)
WRONG_START = "run {i} restored step {saved} but its first ckpt.step() was step {first}, not {next}: "
# the fix, by who calls restore() and counts the steps: the script, or its framework's callback
NEVER_RESTORED_FIX = {
    None: "call `step = ckpt.restore(state)` before the training loop and continue from the step it returns; " + ADAPT,
    "lightning": "pass SlurmResume() in the Trainer's callbacks in every run (slurmresume.integrations.lightning): "
                 "it restores in the Trainer's setup; " + ADAPT,
    "transformers": "train with trainer.train(resume_from_checkpoint=resume.resume_from(trainer)), resume being "
                    "the SlurmResumeCallback in the Trainer's callbacks; " + ADAPT,
}
WRONG_START_FIX = {
    None: "continue counting from the step restore() returns; " + ADAPT,
    "lightning": "the Trainer did not go on from the checkpoint SlurmResume restored: something in the script set "
                 "it aside (a callback or hook that drops or replaces what was loaded, a second Trainer or fit(), "
                 "a step count of its own); SlurmResume restores by itself: give it nothing else to resume from; "
                 + ADAPT,
    "transformers": "the Trainer did not go on from the checkpoint: pass what resume.resume_from(trainer) returns to "
                    "trainer.train(resume_from_checkpoint=...), and nothing else; " + ADAPT,
}
PARTIAL_EPOCH = ("metric(s) {keys} not compared at {n} step record(s) of the preempted run (steps {first}-{last}): "
                 "epoch aggregates of an epoch a resumed run ran only part of (the framework rebuilds them from "
                 "the batches it ran); every other step and metric was compared")
METRIC_HINT = ("a value the step computes from something outside the saved state: an evaluation generator or "
               "loader that is not in state (seed it per evaluation, or put it in state), a metric accumulated "
               "outside state; or pass --ignore KEY for a wall-clock value; " + ADAPT)


@dataclass(frozen=True)
class RunFacts:
    """One run (torchrun invocation) of the preempted drill run, in the order they ran."""

    run_id: str
    restored: int | None  # the step restore() loaded; None: this run never restored one
    first_step: int | None  # the first step it passed to ckpt.step(); None: it ran no step
    committed: int | None  # the step its emergency save committed; None: it committed none


@dataclass(frozen=True)
class MetricDifference:
    step: int
    key: str
    rank: int
    reference: str  # the value (as JSON) in the uninterrupted run
    resumed: str  # ... and in the preempted run

    def __str__(self) -> str:
        return (f"rank {self.rank}: metric '{self.key}' differs first at step {self.step} (uninterrupted "
                f"{_short(self.reference)}, preempted {_short(self.resumed)}): {METRIC_HINT}")


def resumption_problems(runs: list[RunFacts], reference_steps: list[int] | None = None,
                        framework: str | None = None) -> list[str]:
    """One line per restarted run that did not resume what the run before it committed.
    `reference_steps`: the steps the uninterrupted run passed to ckpt.step(), in order: after
    step s a resumed run must go on from the one that followed s there (s + 1 when s is not
    among them). `framework` ('lightning', 'transformers' or None: the script's own loop)
    picks the fix each line names."""
    following = dict(zip(reference_steps or [], (reference_steps or [])[1:], strict=False))
    never, wrong = NEVER_RESTORED_FIX.get(framework, NEVER_RESTORED_FIX[None]), \
        WRONG_START_FIX.get(framework, WRONG_START_FIX[None])
    problems = []
    for i, (prev, run) in enumerate(zip(runs, runs[1:], strict=False), start=2):
        saved = prev.committed
        if saved is None:
            continue  # nothing committed (a hang, a failed save): the other checks judge it
        expected = following.get(saved, saved + 1)
        if run.restored is None:
            problems.append(NEVER_RESTORED.format(i=i, saved=saved, first=run.first_step) + never)
        elif run.restored != saved:
            problems.append(WRONG_RESTORE.format(i=i, restored=run.restored, saved=saved))
        elif run.first_step is not None and run.first_step != expected:
            problems.append(WRONG_START.format(i=i, saved=saved, first=run.first_step, next=expected) + wrong)
    return problems


def reference_steps(records: Path) -> list[int]:
    """The steps rank 0 of the uninterrupted run passed to ckpt.step(), in order, each once."""
    return list(dict.fromkeys(r["step"] for r in read_records(records, 0) if r.get("call") == "step"))


def partial_epoch_note(resumed: dict[int, list[dict[str, Any]]]) -> str:
    """What the metric comparison left out: the keys the preempted run's records marked as
    aggregates of a partly-run epoch (see Checkpointer.step's partial_epoch_metrics); "" if none."""
    keys: set[str] = set()
    steps: set[tuple[int, str]] = set()
    for records in resumed.values():
        for r in records:
            marked = r.get("partial_epoch") or []
            if marked:
                keys.update(map(str, marked))
                steps.add((r["step"], str(r.get("call"))))
    if not keys:
        return ""
    quoted = ", ".join(f"'{k}'" for k in sorted(keys))
    return PARTIAL_EPOCH.format(keys=quoted, n=len(steps), first=min(steps)[0], last=max(steps)[0])


def first_metric_difference(reference: dict[int, list[dict[str, Any]]], resumed: dict[int, list[dict[str, Any]]],
                            ignore: tuple[str, ...] = ()) -> MetricDifference | None:
    """The first (step, key) at which a rank's metrics differ between the runs, comparing every
    record of a step in the preempted run (a replayed step must repeat itself) with the
    uninterrupted run's; steps and keys only one run recorded are not compared. `ignore`: key
    patterns (fnmatch)."""
    found: list[MetricDifference] = []
    for rank in sorted(set(reference) & set(resumed)):
        ref = _by_call(reference[rank])
        for (step, call), records in sorted(_all_by_call(resumed[rank]).items()):
            if (step, call) not in ref:
                continue
            for record in records:
                # a key either record marks as a partly-run epoch's aggregate is left out (and noted)
                skip = (*ignore, *_partial(ref[(step, call)]), *_partial(record))
                diff = _differs(ref[(step, call)].get("metrics"), record.get("metrics"), skip)
                if diff is not None:
                    found.append(MetricDifference(step, diff[0], rank, diff[1], diff[2]))
                    break
    return min(found, key=lambda d: (d.step, d.rank, d.key), default=None)


def _partial(record: dict[str, Any]) -> tuple[str, ...]:
    marked = record.get("partial_epoch")
    # keys, not patterns: a marked name with [ or * in it must not leave out others
    return tuple(_literal(str(k)) for k in marked) if isinstance(marked, list) else ()


def _literal(key: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in key)


def _by_call(records: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    out: dict[tuple[int, str], dict[str, Any]] = {}
    for r in records:
        out.setdefault((r["step"], str(r.get("call"))), r)
    return out


def _all_by_call(records: list[dict[str, Any]]) -> dict[tuple[int, str], list[dict[str, Any]]]:
    out: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in records:
        out.setdefault((r["step"], str(r.get("call"))), []).append(r)
    return out


def _differs(a: Any, b: Any, ignore: tuple[str, ...]) -> tuple[str, str, str] | None:
    """(key, a, b) of the first differing key; values compared as canonical JSON (bitwise floats)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        a, b = {"metrics": a}, {"metrics": b}
    # only keys both passed: a framework's metrics may carry a stale value (Lightning's last
    # val_loss) that a resumed process has not computed yet
    for key in sorted(set(a) & set(b)):
        if any(fnmatch.fnmatchcase(key, pattern) for pattern in ignore):
            continue
        va, vb = dumps(a[key]), dumps(b[key])
        if va != vb:
            return key, va, vb
    return None


def _short(text: str) -> str:
    return text if len(text) <= 40 else text[:37] + "..."


def run_facts(root: Path, records: Path) -> list[RunFacts]:
    """The runs of the preempted drill run under `root`, in the order they started."""
    events = read_events(root)
    order = [e["run_id"] for e in events if e["event"] == EV_STARTED and isinstance(e.get("run_id"), str)]
    restored = {e.get("run_id"): e["step"] for e in events if e["event"] == EV_RESTORED and isinstance(e.get("step"), int)}
    first: dict[str, int] = {}
    for rec in read_records(records, 0):
        if rec.get("call") == "step":  # a run restored at the last step only makes its final save
            first.setdefault(str(rec.get("run")), rec["step"])
    # What each run's emergency save committed, as the launcher judged it from the run's outcome
    # record (it believes only its own launch's records, by nonce) and logged in `run_ended`
    saved = {e.get("run_id"): e.get("saved_step") for e in events if e["event"] == EV_RUN_ENDED}
    facts = []
    for run_id in dict.fromkeys(order):
        committed = saved.get(run_id)
        facts.append(RunFacts(run_id, restored.get(run_id), first.get(run_id),
                              committed if isinstance(committed, int) else None))
    return facts


def metric_streams(records: Path, world: int) -> dict[int, list[dict[str, Any]]]:
    return {rank: read_records(records, rank) for rank in range(world)}


# A ResumableSampler's saved state (train/sampler.py) whose position is still 0 at the end of a
# run that trained steps: the loop never calls `sampler.advance()`, so a resumed run starts its
# epoch over (the state is equal in both runs; only what the data feeds differs)
SAMPLER_KEYS = frozenset({"epoch", "position", "seed", "num_replicas"})
NOT_ADVANCED = ("the sampler '{key}' was never advanced (its saved position is 0 at step {step}), so each resumed "
                "run starts its epoch over: call `sampler.advance(batch_size)` after each batch; " + ADAPT)


def unadvanced_samplers(step_dir: Path, step: int) -> list[str]:
    """State keys of rank 0's ResumableSampler entries saved at position 0 after `step` > 0 steps."""
    from ..checkpoint.jsonenc import loads
    from ..checkpoint.manifest import read_manifest
    from ..checkpoint.shard import SKELETON_KEY
    from ..checkpoint.shardread import load_tensors

    if step <= 0:
        return []
    shard = read_manifest(step_dir).shards[0]
    _, meta, _ = load_tensors(step_dir, shard["file"], shard["bytes"])
    entries = loads(meta.get(SKELETON_KEY, "{}"), "skeleton").get("entries") or {}
    return [key for key, entry in sorted(entries.items()) if isinstance(entry, dict)
            and isinstance(entry.get("value"), dict) and set(entry["value"]) == SAMPLER_KEYS
            and entry["value"].get("position") == 0]


def name_unadvanced(differences: list[Any], samplers: list[str], step: int) -> None:
    """The first failing difference, when what the data feeds differs (a plain value, the
    optimizer, the model) and a sampler was never advanced: name the sampler."""
    lead = next((d for d in differences if not d.note.startswith("never seeded")), None)
    if samplers and lead is not None and lead.cause in {"value", "hyper", "optimizer", "model"}:
        lead.note = NOT_ADVANCED.format(key=samplers[0], step=step)

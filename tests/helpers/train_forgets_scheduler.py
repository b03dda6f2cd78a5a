"""examples/train.py, made deliberately NOT resumable: its LR scheduler is left out of every
checkpoint (a classic bug). `slurmresume drill` must catch it and say so."""

import runpy
import sys
from pathlib import Path

from slurmresume.train import checkpointer as c

EXAMPLE = str(Path(__file__).resolve().parents[2] / "examples" / "train.py")


def _without_scheduler(state):
    return {k: v for k, v in state.items() if k != "scheduler"}


_prepare, _restore = c.Checkpointer._prepare_payload, c.Checkpointer.restore


def _prepare_payload(self, step, state, metrics, meta):
    return _prepare(self, step, _without_scheduler(state), metrics, meta)


def _restore_forgetting(self, state, **kw):
    sub = _without_scheduler(state)
    step = _restore(self, sub, **kw)
    state.update(sub)
    return step


c.Checkpointer._prepare_payload = _prepare_payload
c.Checkpointer.restore = _restore_forgetting
sys.argv = [EXAMPLE, *sys.argv[1:]]
runpy.run_path(EXAMPLE, run_name="__main__")

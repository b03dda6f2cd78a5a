"""Hugging Face `Trainer`: `SlurmResumeCallback` gets slurmresume's guarantees.

    from slurmresume.integrations.transformers import SlurmResumeCallback

    resume = SlurmResumeCallback()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[resume])
    trainer.train(resume_from_checkpoint=resume.resume_from(trainer))      # None on a fresh start

What it does (every rank):
- `resume_from(trainer)` (collective): creates a `slurmresume.Checkpointer` (flag-only handlers
  for the warning signal and SIGTERM) and loads the newest complete checkpoint: the model's
  weights into `trainer.model`, and keeps the optimizer, LR scheduler, `TrainerState` and this
  rank's RNG states for later. It returns a small directory (per rank, under $TMPDIR) holding
  `trainer_state.json` and the restored weights as `model.safetensors`, so that `Trainer.train`
  takes its own resume path: it skips the batches already trained in the current epoch
  (unless `ignore_data_skip`) and restores its counters. No pickle is written or read: there is
  no `optimizer.pt`/`rng_state.pth`; the callback restores those itself.
- `on_train_begin`: loads the optimizer and LR scheduler states.
- the RNG states are put back exactly where `Trainer` would put back its own: before the
  epoch's data iterator is created when the checkpoint ended an epoch, else after the skipped
  batches have been drawn (at the first `on_step_begin`).
- after each optimizer step (`on_step_end`, or, when Trainer evaluates or saves at that step,
  once it did: `on_evaluate`/`on_save`): `Checkpointer.step(global_step, ...)`: the per-step
  agreement; on the warning every rank saves that same step and exits for the launcher to
  requeue. Periodic saves follow `save_every` / `save_policy`. The last step (`max_steps`) is
  saved as the final checkpoint (what `slurmresume drill` compares).

transformers itself is imported only by this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import tempfile
from typing import Any

from transformers import TrainerCallback

from ..train import rng
from ..train.checkpointer import Checkpointer

log = logging.getLogger("slurmresume")


class _Holder:
    """A state entry whose value is applied later (the optimizer does not exist yet at restore)."""

    def __init__(self, live: Any = None) -> None:
        self.live = live
        self.loaded: Any = None

    def state_dict(self) -> Any:
        if callable(self.live):
            return self.live()
        return {} if self.live is None else self.live.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.loaded = state


class SlurmResumeCallback(TrainerCallback):
    """Preemption-safe training for a Hugging Face `Trainer` under `slurmresume submit`/`drill`.

    Args (keyword-only; the `Checkpointer`'s):
        root: checkpoint root; default `$SLURMRESUME_CKPT_DIR` (set by `slurmresume submit`).
        save_every: a periodic save every N optimizer steps (None: on the warning and at the end).
        save_policy: a `slurmresume.SavePolicy` instead of `save_every`.
        retention: a `slurmresume.RetentionPolicy` applied after each commit.
        verify_on_restore: recompute shard checksums before loading.
        final_save: save the last step of training (what `slurmresume drill` compares).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, save_every: int | None = None,
                 save_policy: Any = None, retention: Any = None, verify_on_restore: bool = False,
                 final_save: bool = True) -> None:
        self.root = root
        self.options = {"save_every": save_every, "save_policy": save_policy, "retention": retention,
                        "verify_on_restore": verify_on_restore}
        self.final_save = final_save
        self.ckpt: Checkpointer | None = None
        self._busy: contextlib.ExitStack | None = None  # Trainer's evaluation/save after a step, under ckpt.busy()
        self.restored_step = 0
        self._state: dict[str, Any] = {}
        self._pending: dict[str, Any] = {}
        self._resume_dir: str | None = None
        self._deferred: int | None = None  # a step whose boundary waits for its evaluation / save

    # -- restore ----------------------------------------------------------------------------

    def _open(self, trainer: Any) -> Checkpointer:
        if self.ckpt is None:
            self.ckpt = Checkpointer(self.root, **self.options)
            self._state = {"model": trainer.model, "optimizer": _Holder(), "scheduler": _Holder(),
                           "trainer_state": _Holder(lambda: dataclasses.asdict(trainer.state))}
        return self.ckpt

    def resume_from(self, trainer: Any) -> str | None:
        """Collective. Restore the newest complete checkpoint (model now, the rest during
        training) and return the directory for `trainer.train(resume_from_checkpoint=...)`,
        or None on a fresh start."""
        ckpt = self._open(trainer)
        before = rng.capture()
        self.restored_step = ckpt.restore(self._state)
        if self.restored_step == 0:
            return None
        # Trainer draws from the RNGs while it prepares and skips data; the saved states go back
        # in where Trainer would load its own rng_state.pth (see on_epoch_begin/on_step_begin).
        self._pending = {"rng": rng.capture(), "optimizer": self._state["optimizer"].loaded,
                         "scheduler": self._state["scheduler"].loaded,
                         "trainer_state": self._state["trainer_state"].loaded}
        rng.restore(before)
        self._resume_dir = _write_resume_dir(trainer, self._pending["trainer_state"])
        return self._resume_dir

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, lr_scheduler: Any = None,
                       **kwargs: Any) -> None:
        if self.ckpt is None:
            raise RuntimeError("SlurmResumeCallback: call trainer.train(resume_from_checkpoint="
                               "callback.resume_from(trainer)) so that it can restore before training")
        self._state["optimizer"].live = optimizer
        self._state["scheduler"].live = lr_scheduler
        if self._pending.get("optimizer") is not None:
            optimizer.load_state_dict(self._pending.pop("optimizer"))
        if self._pending.get("scheduler") is not None:
            lr_scheduler.load_state_dict(self._pending.pop("scheduler"))

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Trainer loads its RNG file before creating the iterator when no batch of this epoch was
        # trained yet (a checkpoint that ended an epoch: its fractional epoch is whole).
        if "rng" in self._pending and float(state.epoch or 0).is_integer():
            rng.restore(self._pending.pop("rng"))

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._busy_end()
        if "rng" in self._pending:  # mid-epoch: after the skipped batches were drawn
            rng.restore(self._pending.pop("rng"))
        if self._resume_dir is not None:
            shutil.rmtree(self._resume_dir, ignore_errors=True)
            self._resume_dir = None

    # -- the step boundary ------------------------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.ckpt is None:
            return
        if control.should_evaluate or control.should_save:
            # Trainer evaluates and saves after on_step_end: the step ends once they ran (an
            # evaluation draws from the global RNG; a resumed run would skip it)
            self._deferred = state.global_step
            self._busy_begin(control)
            return
        self._step_boundary(state)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._deferred == state.global_step and not control.should_save:
            self._step_boundary(state)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._deferred == state.global_step:
            self._step_boundary(state)

    def _step_boundary(self, state: Any) -> None:
        self._deferred = None
        self._busy_end()
        if self.ckpt is None:
            return
        metrics = {"loss": state.log_history[-1]["loss"]} if state.log_history and "loss" in state.log_history[-1] \
            else None
        self.ckpt.step(state.global_step, self._state, metrics=metrics)
        if self.final_save and state.max_steps and state.global_step >= state.max_steps:
            self.ckpt.save(state.global_step, self._state, metrics=metrics, reason="final")

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._busy_begin(control)

    def _busy_begin(self, control: Any) -> None:
        """Trainer evaluates, predicts and saves its own checkpoint after on_step_end/on_epoch_end
        when the flow callback (first in the list) set these flags: under ckpt.busy() until the
        deferred step boundary (or the next step) begins, so the hang watch judges them by the
        busy budget."""
        wanted = getattr(control, "should_evaluate", False) or getattr(control, "should_save", False)
        if self.ckpt is not None and self._busy is None and wanted:
            self._busy = contextlib.ExitStack()
            self._busy.enter_context(self.ckpt.busy("evaluate/save"))

    def _busy_end(self) -> None:
        if self._busy is not None:
            stack, self._busy = self._busy, None
            stack.close()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._busy_end()
        if self.ckpt is None:
            return
        if self.final_save and self.ckpt.last_saved_step != state.global_step:
            self.ckpt.save(state.global_step, self._state, reason="final")  # stopped early
        self.ckpt.close()
        self.ckpt = None


def _write_resume_dir(trainer: Any, trainer_state: dict[str, Any]) -> str:
    """What `Trainer.train(resume_from_checkpoint=...)` reads: trainer_state.json and the
    (already restored) weights; nothing pickled. One directory per rank, so no rank waits."""
    import json

    from safetensors.torch import save_model

    path = tempfile.mkdtemp(prefix="slurmresume-hf-")
    with open(os.path.join(path, "trainer_state.json"), "w") as f:
        json.dump(trainer_state, f)
    save_model(trainer.model, os.path.join(path, "model.safetensors"))  # tied weights stored once
    return path

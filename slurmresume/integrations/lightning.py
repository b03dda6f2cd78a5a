"""Lightning: `Trainer(callbacks=[SlurmResume()])` gets slurmresume's guarantees.

    from slurmresume.integrations.lightning import ResumableDataLoader, SlurmResume

    loader = ResumableDataLoader(dataset, batch_size=32, shuffle=True, seed=0)   # exact data position
    trainer = pl.Trainer(callbacks=[SlurmResume()], ...)
    trainer.fit(model, loader)

What the callback does (every rank):
- `setup`: turns Lightning's own SLURM handling off -- `SLURMEnvironment.auto_requeue` is set to
  False and the trainer's signal connector installs nothing, so Lightning neither saves nor runs
  `scontrol requeue` inside a signal handler, nor broadcasts from its SIGTERM handler -- then
  creates a `slurmresume.Checkpointer` (flag-only handlers for the warning signal and SIGTERM)
  and loads the newest complete checkpoint, if any, into Lightning's own restore path (model,
  callbacks, loops' progress, optimizers, LR schedulers, precision plugin, datamodule,
  dataloader position), and this rank's Python/NumPy/torch RNG states.
- after each optimizer step, once every `on_train_batch_end` ran (the callbacks', in any order,
  then the LightningModule's own, which the callback wraps in `setup`): advances each
  `ResumableDataLoader`, then
  `Checkpointer.step(global_step, ...)`: the per-step agreement across ranks; on the warning
  every rank saves that same step (Lightning's checkpoint dict, built by Lightning's
  `dump_checkpoint`, stored without pickle: tensors in safetensors, the rest in tagged JSON)
  and exits for the launcher to requeue. Periodic saves follow `save_every` / `save_policy`.
- the last step of training is saved as the final checkpoint (`slurmresume drill` compares it).
- the metrics of each step are Lightning's `callback_metrics`; after a mid-epoch restore, the
  epoch aggregates (`self.log(..., on_epoch=True)` in training) of that epoch cover only the
  batches this process ran: they are passed as `partial_epoch_metrics`, which the drill leaves
  out of its comparison (and says so) until a whole epoch ran.

Lightning itself is imported only by this module.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sized
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments.slurm import SLURMEnvironment
from torch.utils.data import DataLoader

from ..checkpoint.jsonenc import encode
from ..errors import ConfigError
from ..train.checkpointer import Checkpointer
from ..train.sampler import ResumableSampler

log = logging.getLogger("slurmresume")

STATE_KEY = "lightning"  # the one entry of the slurmresume state: Lightning's checkpoint dict
_HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")
# Lightning's callback_metrics at the save (not in its own checkpoint): a save after an epoch's
# last validation resumes past that validation, and the epoch-end hooks that follow (EarlyStopping
# checking on train epoch end, its default) must read the values the uninterrupted run's read;
# without them the resumed run stopped with "Early stopping conditioned on metric `val_loss`
# which is not available"
METRICS_KEY = "slurmresume_callback_metrics"


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A `DataLoader` over a `slurmresume.ResumableSampler` whose position is part of
    Lightning's checkpoint (Lightning saves and restores loaders that have `state_dict()`).

    `SlurmResume` advances it by one batch after each training batch. Pass `sampler=` to use
    your own `ResumableSampler`; otherwise one is built from `shuffle`, `seed`, `drop_last`
    (ranks and world size from torch.distributed). Lightning keeps a sampler that already is a
    `DistributedSampler`, so `use_distributed_sampler` needs no change."""

    def __init__(self, dataset: Any, batch_size: int = 1, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, sampler: ResumableSampler | None = None, **kwargs: Any) -> None:
        if sampler is None:
            if not isinstance(dataset, Sized):
                raise ConfigError("ResumableDataLoader needs a dataset with len() (a map-style dataset)")
            sampler = ResumableSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last)
        elif not isinstance(sampler, ResumableSampler):
            raise ConfigError(f"sampler must be a slurmresume.ResumableSampler, got {type(sampler).__name__}")
        # Its own generator: creating an iterator otherwise draws a seed from the global torch RNG,
        # and a resumed run creates one more iterator (mid-epoch) than an uninterrupted one.
        kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        super().__init__(dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **kwargs)

    def __len__(self) -> int:
        # Batches in a whole epoch, also mid-epoch: Lightning sizes every epoch from the length it
        # reads once at set-up (after restoring the position) and counts restored batches itself.
        assert isinstance(self.sampler, ResumableSampler)
        n, bs = self.sampler.num_samples, self.batch_size or 1
        return n // bs if self.drop_last else -(-n // bs)

    def advance_one_batch(self) -> None:
        assert isinstance(self.sampler, ResumableSampler)
        self.sampler.advance(self.batch_size or 1)

    def state_dict(self) -> dict[str, Any]:
        assert isinstance(self.sampler, ResumableSampler)
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert isinstance(self.sampler, ResumableSampler)
        self.sampler.load_state_dict(state)


class _TrainerState:
    """The slurmresume state entry: Lightning's checkpoint dict, built only when a save happens.
    On restore `state_dict()` is empty (nothing to compare against yet) and `load_state_dict`
    keeps the decoded dict for Lightning's own restore."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.restoring = False
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.restoring:
            return {}
        checkpoint = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        for key in _HPARAM_KEYS:
            if key in checkpoint:
                checkpoint[key] = _jsonable_hparams(checkpoint[key])
        # omegaconf's container *type* (a class) is not data; hparams are kept as a plain dict.
        checkpoint.pop(getattr(pl.LightningModule, "CHECKPOINT_HYPER_PARAMS_TYPE", ""), None)
        # not the training epoch aggregates: recomputed at each epoch end, and after a mid-epoch
        # resume that epoch's differs (partial_epoch_metrics); the saved state must not
        aggregates = set(epoch_aggregates(self.trainer, epoch_end=True))
        checkpoint[METRICS_KEY] = {key: value.detach().cpu().clone() for key, value in
                                   self.trainer.callback_metrics.items()
                                   if isinstance(value, torch.Tensor) and key not in aggregates}
        return checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


def _jsonable_hparams(hparams: Any) -> Any:
    """Hyper-parameters are not needed to resume; a value JSON cannot hold exactly (a class, a
    Path, an enum) is kept as its repr, with a warning, rather than failing the save."""
    if not isinstance(hparams, dict):
        return hparams
    out = {}
    for key, value in hparams.items():
        try:
            encode(value)
            out[key] = value
        except ConfigError:
            log.warning("hyper-parameter %r (%s) is stored as its repr in the checkpoint", key, type(value).__name__)
            out[key] = repr(value)
    return out


class SlurmResume(pl.Callback):
    """Preemption-safe training for a Lightning `Trainer` under `slurmresume submit`/`drill`.

    Args (keyword-only; the `Checkpointer`'s):
        root: checkpoint root; default `$SLURMRESUME_CKPT_DIR` (set by `slurmresume submit`).
        save_every: a periodic save every N optimizer steps (None: on the warning and at the end).
        save_policy: a `slurmresume.SavePolicy` instead of `save_every`.
        retention: a `slurmresume.RetentionPolicy` applied after each commit.
        async_save: periodic saves written in the background.
        verify_on_restore: recompute shard checksums before loading.
        final_save: save the last step of training (what `slurmresume drill` compares).
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, *, save_every: int | None = None,
                 save_policy: Any = None, retention: Any = None, async_save: bool = False,
                 verify_on_restore: bool = False, final_save: bool = True) -> None:
        self.root = root
        self.options = {"save_every": save_every, "save_policy": save_policy, "retention": retention,
                        "async_save": async_save, "verify_on_restore": verify_on_restore}
        self.final_save = final_save
        self.ckpt: Checkpointer | None = None
        self._busy: contextlib.ExitStack | None = None  # an evaluation loop in progress, under ckpt.busy()
        self.restored_step = 0
        self._state: dict[str, Any] = {}
        self._last_step: int | None = None
        self._unhook: list[tuple[Any, str, Any]] | None = None  # (module, hook, its own) wrapped by ours
        self._deferred: int | None = None  # a step whose boundary waits for its validation
        self._partial_epoch: int | None = None  # the epoch this process restored into the middle of
        self._aggregated_epoch: int | None = None  # the last epoch whose end ran in this process
        self._epoch_end_since_batch = False  # callback_metrics' plain names hold epoch values
        self._restored_metrics: dict[str, Any] = {}  # callback_metrics at the restored save (METRICS_KEY)

    # -- set-up: Lightning's handlers off, ours on, restore through Lightning's own path --------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.ckpt is not None:
            return
        disable_lightning_signal_handling(trainer)
        self._hook_after_module(trainer, pl_module)
        self.ckpt = Checkpointer(self.root, **self.options)
        holder = _TrainerState(trainer)
        self._state = {STATE_KEY: holder}
        holder.restoring = True
        try:
            self.restored_step = self.ckpt.restore(self._state)
        finally:
            holder.restoring = False
        # the restored step's boundary ran before its save: a batch that steps no optimizer (the
        # first micro-batch of an accumulation, a manual step that skips) is no boundary here either
        self._last_step = self.restored_step
        if holder.loaded is not None:
            # Lightning's `_run` restores from `_loaded_checkpoint` right after this hook (model,
            # datamodule, callbacks), then loops, optimizers and schedulers; `resume_end` frees it.
            connector = trainer._checkpoint_connector
            if connector._loaded_checkpoint:
                raise ConfigError("Trainer.fit(ckpt_path=...) and SlurmResume both restore: drop ckpt_path, "
                                  "SlurmResume resumes from the newest complete checkpoint itself")
            self._restored_metrics = holder.loaded.pop(METRICS_KEY, None) or {}
            connector._loaded_checkpoint = holder.loaded
            holder.loaded = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _finish_epoch_restart(trainer.fit_loop)
        trainer._logger_connector._callback_metrics.update(self._restored_metrics)
        self._restored_metrics = {}
        if self.restored_step and trainer.fit_loop.restarted_mid_epoch:
            self._partial_epoch = trainer.current_epoch
        wrapper = getattr(trainer.strategy, "model", None)  # strategy="ddp" wraps after setup's restore
        if self.ckpt is not None and isinstance(wrapper, torch.nn.parallel.DistributedDataParallel):
            self.ckpt.track_ddp(STATE_KEY, wrapper)  # its bucket layout saved, and restored before the first step

    # -- the step boundary ------------------------------------------------------------------

    def _hook_after_module(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The step boundary runs after the LightningModule's own `on_train_batch_end`, which
        Lightning calls after every callback's (whatever their order in `callbacks=[...]`): an
        emergency save then holds what every hook of the step did (an EMA updated there). When a
        validation is due at the step, after the module's `on_validation_end` instead (after
        every callback's: EarlyStopping), where Lightning's own ModelCheckpoint saves: the resumed
        run then goes on after that validation, as the uninterrupted one did."""
        def on_train_batch_end(outputs: Any, batch: Any, batch_idx: int) -> None:
            train_batch_end(outputs, batch, batch_idx)
            self._epoch_end_since_batch = False
            self._step_boundary(trainer)

        def on_validation_end() -> None:
            validation_end()
            if self._deferred is not None and not trainer.sanity_checking:
                self._commit(trainer)

        train_batch_end, validation_end = pl_module.on_train_batch_end, pl_module.on_validation_end
        self._unhook = [(pl_module, name, pl_module.__dict__.get(name))
                        for name in ("on_train_batch_end", "on_validation_end")]
        pl_module.on_train_batch_end = on_train_batch_end  # type: ignore[method-assign]
        pl_module.on_validation_end = on_validation_end  # type: ignore[method-assign]

    def _step_boundary(self, trainer: pl.Trainer) -> None:
        for loader in _resumable_loaders(trainer):
            loader.advance_one_batch()
        step = trainer.global_step
        if self.ckpt is None or step == self._last_step:
            return  # gradient accumulation: only an optimizer step is a step boundary
        self._last_step = step
        self._deferred = step
        if not _validation_due(trainer):
            self._commit(trainer)

    def _commit(self, trainer: pl.Trainer) -> None:
        """The step boundary of the step `_deferred` names (saves on the warning)."""
        step, self._deferred = self._deferred, None
        if self.ckpt is None or step is None:
            return
        metrics = _metrics(trainer)
        self.ckpt.step(step, self._state, metrics=metrics, partial_epoch_metrics=self._partial(trainer, metrics))
        if self.final_save and _is_last_step(trainer):
            self._save_final(trainer, step)

    def _save_final(self, trainer: pl.Trainer, step: int) -> None:
        assert self.ckpt is not None
        metrics = _metrics(trainer)
        self.ckpt.save(step, self._state, metrics=metrics, reason="final",
                       partial_epoch_metrics=self._partial(trainer, metrics))

    def _partial(self, trainer: pl.Trainer, metrics: dict[str, float]) -> list[str]:
        """The keys of `metrics` that aggregate the epoch this process restored into the middle
        of: Lightning rebuilds them from the batches it ran here, not the whole epoch (its
        accumulators are not in the checkpoint), so they differ from an uninterrupted run's.
        Exact again once a whole epoch ran here."""
        if self._partial_epoch is None or self._aggregated_epoch != self._partial_epoch:
            return []
        return [key for key in epoch_aggregates(trainer, self._epoch_end_since_batch) if key in metrics]

    # a validation that was due but did not run (skipped): the boundary comes at the next hook
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._commit(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._aggregated_epoch, self._epoch_end_since_batch = trainer.current_epoch, True
        self._commit(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._commit(trainer)
        # Stopped another way (early stopping, time limit): still leave the final state.
        if self.ckpt is not None and self.final_save and self.ckpt.last_saved_step != trainer.global_step:
            self._save_final(trainer, trainer.global_step)

    # -- evaluation loops: under ckpt.busy(), judged by the busy budget (never less than a step's) ----

    def _busy_begin(self, what: str) -> None:
        if self.ckpt is not None and self._busy is None:
            self._busy = contextlib.ExitStack()
            self._busy.enter_context(self.ckpt.busy(what))

    def _busy_end(self) -> None:
        if self._busy is not None:
            stack, self._busy = self._busy, None
            stack.close()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._busy_begin("validation")

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._busy_begin("test")

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._busy_begin("predict")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._busy_end()

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._busy_end()

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._busy_end()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._busy_end()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._busy_end()
        if stage == "fit" and self._unhook is not None:
            for module, name, own in self._unhook:
                if own is None:
                    module.__dict__.pop(name, None)
                else:
                    setattr(module, name, own)
            self._unhook = None
        if stage == "fit" and self.ckpt is not None:
            self.ckpt.close()
            self.ckpt = None


def disable_lightning_signal_handling(trainer: pl.Trainer) -> None:
    """Lightning's SLURM support saves and runs `scontrol requeue` inside its SIGUSR1 handler (on
    rank 0 only) and broadcasts from inside its SIGTERM handler; slurmresume's flag-only handlers
    and step-boundary agreement replace both. Call before `Trainer.fit` starts training (the
    callback does it in `setup`)."""
    env = trainer._accelerator_connector.cluster_environment
    if isinstance(env, SLURMEnvironment) and env.auto_requeue:
        env.auto_requeue = False
        log.info("slurmresume: Lightning's SLURM auto-requeue turned off (slurmresume requeues)")
    connector = getattr(trainer, "_signal_connector", None)
    if connector is not None and hasattr(connector, "register_signal_handlers"):
        connector.register_signal_handlers = lambda: None
    else:  # a Lightning release that moved it: say so rather than run two handlers silently
        log.warning("slurmresume: could not find Lightning's signal connector; its handlers may also run")


def _finish_epoch_restart(fit_loop: Any) -> None:
    """A checkpoint saved at the last batch of an epoch: Lightning's `FitLoop.reset` completes
    that epoch, but the loop stays "restarted mid-epoch", so the next epoch starts without
    `on_train_epoch_start` hooks and without counting itself as started (Lightning 2.6; the
    trained tensors are unaffected). Once the old epoch is complete, the next one is a fresh
    epoch: say so."""
    epoch_loop = fit_loop.epoch_loop
    if (fit_loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end
            and epoch_loop.batch_progress.is_last_batch
            and fit_loop.epoch_progress.total.completed == fit_loop.epoch_progress.total.started):
        fit_loop.reset_restart_stage()


def _resumable_loaders(trainer: pl.Trainer) -> Iterator[ResumableDataLoader]:
    combined = trainer.fit_loop._combined_loader
    for loader in combined.flattened if combined is not None else ():
        if isinstance(loader, ResumableDataLoader):
            yield loader


def _validation_due(trainer: pl.Trainer) -> bool:
    """Lightning's own test, asked at the step's end: will it validate before the next batch?"""
    loop = trainer.fit_loop.epoch_loop
    if getattr(loop, "_skip_next_val", False) or not trainer.enable_validation:
        return False
    fetcher = trainer.fit_loop._data_fetcher
    if fetcher is None:
        return False
    try:
        return bool(loop._should_check_val_fx(fetcher))
    except Exception:  # another Lightning's internals: the boundary comes at once, as before
        return False


def _is_last_step(trainer: pl.Trainer) -> bool:
    if trainer.max_steps is not None and trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:
        return True
    max_epochs = trainer.max_epochs
    return (max_epochs is not None and max_epochs > 0 and trainer.current_epoch + 1 >= max_epochs
            and bool(trainer.fit_loop.epoch_loop.batch_progress.is_last_batch))


def epoch_aggregates(trainer: pl.Trainer, epoch_end: bool) -> list[str]:
    """The callback_metrics keys that hold an epoch value of a metric logged in training with
    on_epoch=True: its epoch name ("loss_epoch" when also logged on_step, else "loss"), and its
    plain name too after an epoch end (until the next batch logs the step value there)."""
    try:
        results = trainer.fit_loop.epoch_loop._results
        keys: set[str] = set()
        for metric in results.values():
            if metric.meta.on_epoch:
                name, forked = results._forked_name(metric, on_step=False)
                keys.update((name, forked) if epoch_end or not metric.meta.on_step else (forked,))
        return sorted(keys)
    except AttributeError:  # another Lightning's internals: compare them all, as before
        return []


def _metrics(trainer: pl.Trainer) -> dict[str, float]:
    out = {}
    for key, value in trainer.callback_metrics.items():
        try:
            out[key] = float(value)
        except (TypeError, ValueError):
            continue
    return out

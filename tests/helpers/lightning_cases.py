"""A small Lightning script for issue #28: state updated where Lightning runs hooks after ours.

    lightning_cases.py --steps N --case module-ema|callback-ema|early-stop[,...]

    module-ema    an EMA of the weights updated in LightningModule.on_train_batch_end (Lightning
                  runs the module's hook after every callback's)
    callback-ema  the same EMA kept by a callback listed after SlurmResume in callbacks=[...]
    early-stop    validation every 4 steps and an EarlyStopping that never sees an improvement
                  (its wait_count grows at each validation); the validation due at the preempted
                  step must run, in the uninterrupted and the preempted run alike

Several cases, comma-separated, run together in one script (one drill covers them all).

Either way the emergency save must hold the saved step's EMA update: one update short per
preemption otherwise, and the final EMA differs from the uninterrupted run's.
"""

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from slurmresume.integrations.lightning import ResumableDataLoader, SlurmResume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--case", default="module-ema", help="one case or several, comma-separated")
args = p.parse_args()
cases = set(args.case.split(","))
pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
dataset = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g))
valset = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))


def ema_update(ema: torch.Tensor, weight: torch.Tensor) -> None:
    ema.mul_(0.9).add_(weight.detach().flatten(), alpha=0.1)


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.register_buffer("ema", torch.zeros(9))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.lin(x), y)
        self.log("loss", loss)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if "module-ema" in cases:
            ema_update(self.ema, torch.cat([self.lin.weight.flatten(), self.lin.bias]))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.lin(x), y), sync_dist=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(valset, batch_size=16)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        return ResumableDataLoader(dataset, batch_size=8, shuffle=True, seed=0, drop_last=True)


class EMACallback(pl.Callback):
    def __init__(self) -> None:
        self.ema = torch.zeros(9)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        ema_update(self.ema, torch.cat([pl_module.lin.weight.flatten(), pl_module.lin.bias]))

    def state_dict(self):
        return {"ema": self.ema}

    def load_state_dict(self, state) -> None:
        self.ema = state["ema"].clone()


callbacks: list[pl.Callback] = [SlurmResume()]
if "callback-ema" in cases:
    callbacks.append(EMACallback())  # after ours
validate = "early-stop" in cases
if validate:
    callbacks.append(pl.callbacks.EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1000))
distributed = "WORLD_SIZE" in os.environ
trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                     strategy="ddp" if distributed else "auto", callbacks=callbacks, enable_checkpointing=False,
                     logger=False, enable_progress_bar=False, enable_model_summary=False, deterministic=True,
                     val_check_interval=4 if validate else None, limit_val_batches=None if validate else 0,
                     num_sanity_val_steps=0)
trainer.fit(Net())

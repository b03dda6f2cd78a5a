"""Two ordinary Lightning shapes whose resume is exact, for the drill (issue #46).

    lightning_shapes.py --steps N --case gan|datamodule [--no-resume]

    gan         manual optimization with two optimizers (a generator and a discriminator):
                Lightning counts every optimizer step, so `global_step` advances by 2 per batch
    datamodule  a LightningDataModule with validation at each epoch's end, gradients accumulated
                over 2 batches (4 optimizer steps per epoch on 1 rank, 2 on 2 ranks: the first
                batch after a resume steps no optimizer) and
                self.log("train_loss", loss, on_step=True, on_epoch=True): an epoch aggregate
                Lightning rebuilds from the batches a process ran, so after a mid-epoch resume it
                differs from the uninterrupted run's until the next whole epoch; and an
                EarlyStopping on val_loss with its default check at the train epoch's end (never
                stops: its wait_count grows at each validation), which a resume past an epoch's
                last validation must feed the val_loss that validation computed
    --no-resume the same script with a callback that throws the restored checkpoint away (the
                checkpoint is read, then ignored): every restart trains again from step 0 to the
                same final state, which the drill must still FAIL
"""

import argparse
import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from slurmresume.integrations.lightning import ResumableDataLoader, SlurmResume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--case", default="gan")
p.add_argument("--no-resume", action="store_true")
args = p.parse_args()
pl.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
val = TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g))


class GAN(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.gen = torch.nn.Linear(2, 4)
        self.disc = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        fake = self.gen(torch.randn(real.size(0), 2, device=self.device))  # the global torch RNG
        ones, zeros = torch.ones(real.size(0), 1), torch.zeros(real.size(0), 1)
        d_loss = (F.binary_cross_entropy_with_logits(self.disc(real), ones)
                  + F.binary_cross_entropy_with_logits(self.disc(fake.detach()), zeros))
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        g_loss = F.binary_cross_entropy_with_logits(self.disc(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self):
        return [torch.optim.Adam(self.gen.parameters(), lr=1e-2), torch.optim.Adam(self.disc.parameters(), lr=1e-2)]

    def train_dataloader(self):
        return ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0, drop_last=True)


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)
        self.drop = torch.nn.Dropout(0.2)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.lin(self.drop(x)), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self.lin(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Data(pl.LightningDataModule):
    def train_dataloader(self):
        return ResumableDataLoader(data, batch_size=8, shuffle=True, seed=0, drop_last=True)

    def val_dataloader(self):
        return DataLoader(val, batch_size=8)


class IgnoreCheckpoint(pl.Callback):
    """The mistake: whatever SlurmResume loaded is dropped before Lightning restores it."""

    def setup(self, trainer, pl_module, stage) -> None:
        trainer._checkpoint_connector._loaded_checkpoint = None


callbacks: list[pl.Callback] = [SlurmResume()]
if args.no_resume:
    callbacks.append(IgnoreCheckpoint())
datamodule = args.case == "datamodule"
if datamodule:
    callbacks.append(pl.callbacks.EarlyStopping(monitor="val_loss", min_delta=10.0, patience=1000))
# manual optimization backpropagates each loss through part of the model
ddp = "ddp" if datamodule else "ddp_find_unused_parameters_true"
trainer = pl.Trainer(max_steps=args.steps, accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                     strategy=ddp if "WORLD_SIZE" in os.environ else "auto", callbacks=callbacks,
                     enable_checkpointing=False, logger=False, enable_progress_bar=False, enable_model_summary=False,
                     deterministic=True,
                     limit_val_batches=None if datamodule else 0, num_sanity_val_steps=0,
                     accumulate_grad_batches=2 if datamodule else 1)
if datamodule:
    trainer.fit(Regressor(), datamodule=Data())
else:
    trainer.fit(GAN())

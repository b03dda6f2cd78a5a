"""A Lightning run as a user of Lightning's own SLURM support has it: `SLURMEnvironment` with
auto-requeue on (its default), SLURM_* variables set by the test. argv: ckpt_dir steps
with_slurmresume(0|1) ready_file. Writes `ready_file` once training is under way."""

import sys
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.environments import SLURMEnvironment
from torch.utils.data import TensorDataset

from slurmresume.integrations.lightning import ResumableDataLoader, SlurmResume

ckpt_dir, steps, with_ours, ready = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", Path(sys.argv[4])


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        if self.global_step >= 2:
            ready.touch()
        time.sleep(0.2)
        return self.lin(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return ResumableDataLoader(TensorDataset(torch.randn(64, 4)), batch_size=4, seed=0)


pl.seed_everything(0, verbose=False)
trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, plugins=[SLURMEnvironment()],
                     callbacks=[SlurmResume(ckpt_dir)] if with_ours else [], enable_checkpointing=False,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=str(Path(ckpt_dir).parent / "lightning_root"))
trainer.fit(Model())
print("finished", trainer.global_step, flush=True)

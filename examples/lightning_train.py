"""A Lightning script that survives preemption: the usual LightningModule + Trainer, plus the
`SlurmResume` callback and a `ResumableDataLoader`. Reads top to bottom.

    python examples/lightning_train.py --steps 40                                 # one process
    torchrun --nproc-per-node 2 examples/lightning_train.py --steps 40            # DDP on gloo
    slurmresume drill examples/lightning_train.py --preemptions 2 -- --steps 24   # prove it resumes exactly
    slurmresume submit examples/lightning_train.py --ckpt-dir /ckpt/run1 -- --steps 10000

The checkpoint root comes from --ckpt-dir or $SLURMRESUME_CKPT_DIR (set by `slurmresume submit`).
"""

import argparse
import math
import os

import lightning.pytorch as pl
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from slurmresume.integrations.lightning import ResumableDataLoader, SlurmResume

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--save-every", type=int, default=None)
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--num-workers", type=int, default=0)
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/lightning"))
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
args = p.parse_args()

pl.seed_everything(args.seed, workers=True, verbose=False)
# Nondeterministic kernels are CUDA's (scatter/index adds, cuBLAS workspaces); on torch 2.13 this call
# also imports torch._inductor, ~3 s of CPU per process and per restart, so a CPU run skips it.
if torch.cuda.is_available():
    torch.use_deterministic_algorithms(True, warn_only=True)

# -- data: a synthetic next-token task generated from the seed (64 sequences: epochs are short,
#    so a drill also crosses epoch boundaries) --
vocab, ctx, n_seq = 64, 32, 64
g = torch.Generator().manual_seed(args.seed)
seqs = (torch.arange(ctx + 1)[None, :] * torch.randint(1, 7, (n_seq, 1), generator=g)
        + torch.randint(0, vocab, (n_seq, 1), generator=g)) % vocab
dataset = TensorDataset(seqs[:, :-1], seqs[:, 1:])


# -- model: a tiny causal transformer with dropout, AdamW, warm-up + cosine --
class TinyGPT(pl.LightningModule):
    def __init__(self, lr: float, steps: int, d: int = 32, heads: int = 4, layers: int = 2, dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(ctx, d))
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), device=x.device)
        return self.head(self.blocks(self.tok(x) + self.pos, mask=mask, is_causal=True))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("loss", loss, prog_bar=False)
        if args.step_sleep:
            import time

            time.sleep(args.step_sleep)  # tests widen the window in which a signal lands
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)
        total, warmup = self.hparams.steps, max(1, self.hparams.steps // 10)
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        # Built here, after Lightning has set up torch.distributed, so the sampler splits by rank.
        return ResumableDataLoader(dataset, batch_size=args.batch_size, shuffle=True, seed=args.seed,
                                   drop_last=True, num_workers=args.num_workers)


distributed = "WORLD_SIZE" in os.environ
trainer = pl.Trainer(
    max_steps=args.steps,
    accelerator="cpu",
    devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
    num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)) if distributed else 1,
    strategy="ddp" if distributed else "auto",
    callbacks=[SlurmResume(args.ckpt_dir, save_every=args.save_every)],  # <- slurmresume
    enable_checkpointing=False,  # SlurmResume saves; Lightning's ModelCheckpoint is optional
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    deterministic=True,
)
trainer.fit(TinyGPT(args.lr, args.steps))
if trainer.global_rank == 0:
    print(f"done at step {trainer.global_step}, epoch {trainer.current_epoch}", flush=True)

"""A Hugging Face `Trainer` script that survives preemption: a tiny GPT-2 built from a config
(no download), a synthetic dataset, the stock `Trainer`, plus `SlurmResumeCallback`. Reads top
to bottom.

    python examples/hf_trainer_train.py --steps 40                                 # one process
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --steps 40            # DDP on gloo
    slurmresume drill examples/hf_trainer_train.py --preemptions 2 -- --steps 24   # prove it resumes exactly

The checkpoint root comes from --ckpt-dir or $SLURMRESUME_CKPT_DIR (set by `slurmresume submit`).
"""

import argparse
import os
import tempfile
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from slurmresume.integrations.transformers import SlurmResumeCallback

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=200)
p.add_argument("--save-every", type=int, default=None)
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--lr", type=float, default=3e-3)
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/hf"))
p.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
p.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (0: never)")
p.add_argument("--no-find-unused", action="store_true",
               help="ddp_find_unused_parameters=False (faster; DDP then rebuilds its gradient buckets)")
args = p.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here needs the network


# -- data: a synthetic next-token task generated from the seed (64 sequences: short epochs, so a
#    drill also resumes across epoch boundaries) --
class Sequences(torch.utils.data.Dataset):
    def __init__(self, n=64, ctx=32, vocab=64, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = (torch.arange(ctx)[None, :] * torch.randint(1, 7, (n, 1), generator=g)
                  + torch.randint(0, vocab, (n, 1), generator=g)) % vocab

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


# -- model: a tiny GPT-2 from a config (dropout on, tied embeddings) --
torch.manual_seed(args.seed)
config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)


class SlowSteps(TrainerCallback):  # tests widen the window in which a signal lands
    def on_step_end(self, *a, **k):
        time.sleep(args.step_sleep)


training_args = TrainingArguments(
    output_dir=os.path.join(tempfile.gettempdir(), "hf-trainer-example"),  # HF's own saves are off
    max_steps=args.steps,
    per_device_train_batch_size=args.batch_size,
    learning_rate=args.lr,
    warmup_steps=max(1, args.steps // 10),
    lr_scheduler_type="cosine",
    weight_decay=0.1,
    seed=args.seed,
    save_strategy="no",  # SlurmResumeCallback saves
    logging_strategy="no",
    report_to=[],
    disable_tqdm=True,
    use_cpu=True,
    dataloader_num_workers=0,
    eval_strategy="steps" if args.eval_every else "no",
    eval_steps=args.eval_every or None,
    ddp_find_unused_parameters=False if args.no_find_unused else None,
)
resume = SlurmResumeCallback(args.ckpt_dir, save_every=args.save_every)  # <- slurmresume
trainer = Trainer(model=model, args=training_args, train_dataset=Sequences(seed=args.seed),
                  eval_dataset=Sequences(n=16, seed=args.seed + 1) if args.eval_every else None,
                  callbacks=[resume] + ([SlowSteps()] if args.step_sleep else []))
trainer.train(resume_from_checkpoint=resume.resume_from(trainer))  # <- slurmresume
if trainer.is_world_process_zero():
    print(f"done at step {trainer.state.global_step}, epoch {trainer.state.epoch:.2f}", flush=True)

"""HF Trainer with a masked-language-model collator (tests/test_hf_random_collator.py): a tiny
BERT and a word-level tokenizer built in code (nothing downloads), the stock
`DataCollatorForLanguageModeling` (it draws its masks from the global torch RNG at each batch),
plus `SlurmResumeCallback`.

--collator random: the stock collator. --collator fixed: the same masking with a generator
seeded from the batch's own tokens, so it draws nothing from the global RNG."""

import argparse
import os
import tempfile

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from slurmresume.integrations.transformers import SlurmResumeCallback

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=16)
p.add_argument("--seed", type=int, default=1337)
p.add_argument("--batch-size", type=int, default=4)
p.add_argument("--collator", choices=("random", "fixed"), default="random")
p.add_argument("--ckpt-dir", default=os.environ.get("SLURMRESUME_CKPT_DIR", "runs/hf-mlm"))
args = p.parse_args()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
vocab = {tok: i for i, tok in enumerate(specials + [f"w{i}" for i in range(27)])}
tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                    sep_token="[SEP]", mask_token="[MASK]")


class Sentences(torch.utils.data.Dataset):  # 40 sentences of 16 words: short epochs
    def __init__(self, n=40, seed=0):
        g = torch.Generator().manual_seed(seed)
        words = torch.randint(0, 27, (n, 16), generator=g)
        self.ids = [tokenizer(" ".join(f"w{int(w)}" for w in row))["input_ids"] for row in words]

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i]}


class FixedMasks(DataCollatorForLanguageModeling):
    def torch_call(self, examples):
        key = int(sum(sum(e["input_ids"]) * (i + 1) for i, e in enumerate(examples)))
        state = torch.get_rng_state()
        torch.manual_seed(key)
        try:
            return super().torch_call(examples)
        finally:
            torch.set_rng_state(state)


torch.manual_seed(args.seed)
model = BertForMaskedLM(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=32))
collator = (DataCollatorForLanguageModeling if args.collator == "random" else FixedMasks)(tokenizer, mlm_probability=0.3)
training_args = TrainingArguments(
    output_dir=os.path.join(tempfile.gettempdir(), "hf-mlm-test"), max_steps=args.steps,
    per_device_train_batch_size=args.batch_size, learning_rate=3e-3, seed=args.seed, save_strategy="no",
    logging_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
resume = SlurmResumeCallback(args.ckpt_dir)
trainer = Trainer(model=model, args=training_args, train_dataset=Sentences(seed=args.seed), data_collator=collator,
                  callbacks=[resume])
trainer.train(resume_from_checkpoint=resume.resume_from(trainer))

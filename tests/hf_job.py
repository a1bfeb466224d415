"""Hugging Face Trainer, as a user writes it with `TokenLoomTrainer`: train STEPS steps saving a
checkpoint every K; in a new process ``train(resume_from_checkpoint=<checkpoint-K>)``.

usage: hf_job.py run|resume GLOB TOKENIZER OUT_DIR OUT STEPS K
The input ids each step trained on go to OUT (JSON).
"""

from __future__ import annotations

import os
import sys

from transformers import TrainingArguments

from tokenloom.integrations.hf import TokenLoomTrainer
from trainer_common import build_loader, record, tiny_llama



def main():
    mode, glob, tokenizer, out_dir, out, steps, k = sys.argv[1:]
    steps, k = int(steps), int(k)
    seen = []
    model = tiny_llama()
    original = model.forward

    def forward(*a, **kw):
        if model.training:
            seen.append(kw["input_ids"])
        return original(*a, **kw)

    model.forward = forward
    args = TrainingArguments(output_dir=out_dir, max_steps=steps, save_steps=k, per_device_train_batch_size=2,
                             learning_rate=1e-3, report_to=[], logging_steps=100, use_cpu=True,
                             dataloader_num_workers=0, save_only_model=False, seed=0)
    trainer = TokenLoomTrainer(model=model, args=args, train_loader=build_loader(glob, tokenizer))
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, f"checkpoint-{k}") if mode == "resume" else None)
    record(out, seen)


if __name__ == "__main__":
    main()

"""Hugging Face Trainer with tokenloom's loader: train 8 steps with a checkpoint every 4, then
resume from checkpoint-4 the Trainer's own way and train steps 5-8 again, exactly.

    python examples/hf_trainer.py [WORKDIR]

`TokenLoomTrainer` takes the loader as ``train_loader=`` (no ``train_dataset``): Trainer does not
wrap or re-shard it, does not skip batches by reading them on resume, and every checkpoint folder
holds the loader's state (``checkpoint-N/tokenloom_loader_rank<r>.json``).
"""

import os
import sys

from transformers import TrainingArguments

from _common import TOKENIZER, corpus, tiny_llama, workdir
from tokenloom.integrations.hf import TokenLoomTrainer
from tokenloom.recipes import pretrain


def train(out: str, resume: bool):
    loader = pretrain(corpus(out), tokenizer=TOKENIZER, seq_len=64, batch_size=4, num_workers=2)
    args = TrainingArguments(output_dir=os.path.join(out, "hf"), max_steps=8, save_steps=4, learning_rate=1e-3,
                             per_device_train_batch_size=4, use_cpu=True, report_to=[], logging_steps=4)
    trainer = TokenLoomTrainer(model=tiny_llama(64), args=args, train_loader=loader)
    trainer.train(resume_from_checkpoint=os.path.join(out, "hf", "checkpoint-4") if resume else None)
    return trainer.state.log_history


if __name__ == "__main__":
    out = workdir(sys.argv)
    first = train(out, resume=False)
    again = train(out, resume=True)   # in your job: a new process after a preemption
    loss = lambda history: [h["loss"] for h in history if "loss" in h][-1]  # noqa: E731
    print(f"step 8 loss: uninterrupted {loss(first):.4f}, resumed from step 4 {loss(again):.4f}")
    logged = [h for h in first if "loss" in h][-1]  # the loader's figures are logged beside the loss
    print("logged at step 8:", {k: round(v, 4) for k, v in logged.items() if k.startswith("data/")})

"""PyTorch Lightning, as a user writes it with `TokenLoomDataModule`: fit STEPS steps with a
mid-epoch ``ModelCheckpoint(every_n_train_steps=K)``; in a new process ``fit(ckpt_path=...)``.

usage: lightning_job.py run|resume GLOB TOKENIZER CKPT_DIR OUT STEPS K
The input ids each training step got go to OUT (JSON).
"""

from __future__ import annotations

import glob as globmod
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tokenloom.integrations.lightning import TokenLoomDataModule
from trainer_common import build_loader, loss_of, record, tiny_llama


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = tiny_llama()
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        return loss_of(self.model, batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main():
    mode, glob, tokenizer, ckpt_dir, out, steps, k = sys.argv[1:]
    steps, k = int(steps), int(k)
    module = Module()
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=k, save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoint], num_sanity_val_steps=0)
    ckpt = None
    if mode == "resume":
        ckpt = next(p for p in globmod.glob(os.path.join(ckpt_dir, "*.ckpt")) if f"step={k}" in p)
    trainer.fit(module, datamodule=TokenLoomDataModule(build_loader(glob, tokenizer)), ckpt_path=ckpt)
    record(out, module.seen)


if __name__ == "__main__":
    main()

"""PyTorch Lightning, as a user writes it: fit STEPS steps with a mid-epoch
``ModelCheckpoint(every_n_train_steps=K)``; in a new process ``fit(ckpt_path=...)``.

usage: lightning_job.py run|resume GLOB TOKENIZER CKPT_ROOT OUT_ROOT STEPS K PACKAGE:HOW[,PACKAGE:HOW...]
PACKAGE: ``lightning`` (``lightning.pytorch``) or ``pytorch_lightning``; HOW: ``datamodule``
(`TokenLoomDataModule`) or ``loader`` (the loader returned by the module's ``train_dataloader()``,
as Lightning documents for stateful loaders). Each scenario runs in turn in this process (the imports
are most of a job's time), its checkpoints in CKPT_ROOT/PACKAGE-HOW; the input ids each training step
got go to OUT_ROOT/PACKAGE-HOW.json.
"""

from __future__ import annotations

import glob as globmod
import importlib
import os
import sys

import torch

from trainer_common import TinyLM, build_loader, loss_of, record


def main():
    mode, glob, tokenizer, ckpt_root, out_root, steps, k, scenarios = sys.argv[1:]
    for scenario in scenarios.split(","):
        package, how = scenario.split(":")
        name = f"{package}-{how}"
        fit(mode, glob, tokenizer, os.path.join(ckpt_root, name), os.path.join(out_root, name + ".json"), int(steps),
            int(k), package, how)


def fit(mode, glob, tokenizer, ckpt_dir, out, steps, k, package, how):
    pl = importlib.import_module("lightning.pytorch" if package == "lightning" else "pytorch_lightning")
    integration = importlib.import_module(f"tokenloom.integrations.{package}")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = TinyLM()
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(batch["input_ids"].clone())
            return loss_of(self.model, batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class LoaderModule(Module):
        def train_dataloader(self):
            return build_loader(glob, tokenizer)

    module = Module() if how == "datamodule" else LoaderModule()
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=k, save_top_k=-1)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[checkpoint], num_sanity_val_steps=0)
    ckpt = None
    if mode == "resume":
        ckpt = next(p for p in globmod.glob(os.path.join(ckpt_dir, "*.ckpt")) if f"step={k}" in p)
    if how == "datamodule":
        trainer.fit(module, datamodule=integration.TokenLoomDataModule(build_loader(glob, tokenizer)), ckpt_path=ckpt)
    else:
        trainer.fit(module, ckpt_path=ckpt)
    record(out, module.seen)


if __name__ == "__main__":
    main()

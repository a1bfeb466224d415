"""PyTorch Lightning with tokenloom's loader: `TokenLoomDataModule` puts the loader's state in
every checkpoint, taken at the batch last trained on (Lightning fetches one batch ahead, so the
loader's own state at save time would resume one batch late).

    python examples/lightning_fit.py [WORKDIR]
"""

import glob
import os
import sys

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from _common import TOKENIZER, corpus, tiny_llama, workdir
from tokenloom.integrations.lightning import TokenLoomDataModule
from tokenloom.recipes import pretrain


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model, self.seen = tiny_llama(64), []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["input_ids"].clone())
        # the loader's figures, flat (data/wait_ms, data/share/<name>, ...), to the Trainer's logger
        self.log_dict(self.trainer.datamodule.loader.figures(), on_step=True)
        if batch_idx % 4 == 3:
            print(f"step {batch_idx + 1}:", {k: round(v, 4) for k, v in self.trainer.datamodule.loader.figures().items()})
        b = batch  # labels are already shifted: shift_labels uses them as they are
        return self.model(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                          shift_labels=b["labels"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(out: str, ckpt_path=None):
    loader = pretrain(corpus(out), tokenizer=TOKENIZER, seq_len=64, batch_size=4, num_workers=2)
    module = Module()
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         callbacks=[ModelCheckpoint(dirpath=os.path.join(out, "lightning"), every_n_train_steps=4,
                                                    save_top_k=-1)])
    trainer.fit(module, datamodule=TokenLoomDataModule(loader), ckpt_path=ckpt_path)
    return module.seen


if __name__ == "__main__":
    out = workdir(sys.argv)
    first = fit(out)
    step4 = next(p for p in glob.glob(os.path.join(out, "lightning", "*.ckpt")) if "step=4" in p)
    again = fit(out, ckpt_path=step4)   # in your job: a new process after a preemption
    same = all(torch.equal(a, b) for a, b in zip(first[4:], again))
    print(f"steps 5-8 after fit(ckpt_path=) equal the uninterrupted run's: {same}")

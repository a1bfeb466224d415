"""Accelerate, as a user writes it: ``accelerator.prepare(model, optimizer, loader)``, train,
``save_state`` at step K, stop; a new process ``load_state``s and trains on.

usage: accelerate_job.py run|resume GLOB TOKENIZER CKPT_DIR OUT STATEFUL STEPS K
run: STEPS steps, save_state(CKPT_DIR) after step K; resume: load_state(CKPT_DIR), STEPS - K steps.
The input ids each step trained on go to OUT (JSON).
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from trainer_common import build_loader, loss_of, record, tiny_llama


def main():
    mode, glob, tokenizer, ckpt, out, stateful, steps, k = sys.argv[1:]
    steps, k = int(steps), int(k)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=stateful == "1"))
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, build_loader(glob, tokenizer))
    if mode == "resume":
        accelerator.load_state(ckpt)
    seen, todo = [], steps if mode == "run" else steps - k
    for batch in loader:
        seen.append(batch["input_ids"])
        loss = loss_of(model, batch)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if mode == "run" and len(seen) == k:
            accelerator.save_state(ckpt)
        if len(seen) == todo:
            break
    record(out, seen)


if __name__ == "__main__":
    main()

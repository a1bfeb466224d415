"""Accelerate, as a user writes it: ``accelerator.prepare(model, optimizer, loader)``, train,
``save_state`` at step K, stop; a new process ``load_state``s and trains on.

usage: accelerate_job.py run|resume GLOB TOKENIZER CKPT_ROOT OUT_ROOT STATEFUL[,STATEFUL] STEPS K
run: STEPS steps, save_state(CKPT_ROOT/STATEFUL) after step K; resume: load_state(CKPT_ROOT/STATEFUL),
STEPS - K steps. STATEFUL: 1 for ``use_stateful_dataloader=True``, else 0; several run in turn in this
process (the imports are most of a job's time), each with an Accelerator of its own. The input ids each
step trained on go to OUT_ROOT/STATEFUL.json.
"""

from __future__ import annotations

import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration

from trainer_common import TinyLM, build_loader, loss_of, record


def main():
    mode, glob, tokenizer, ckpt_root, out_root, statefuls, steps, k = sys.argv[1:]
    for stateful in statefuls.split(","):
        train(mode, glob, tokenizer, os.path.join(ckpt_root, stateful), os.path.join(out_root, stateful + ".json"),
              stateful, int(steps), int(k))


def train(mode, glob, tokenizer, ckpt, out, stateful, steps, k):
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_stateful_dataloader=stateful == "1"))
    model = TinyLM()
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

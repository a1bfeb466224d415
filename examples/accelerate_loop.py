"""Accelerate with tokenloom's loader: ``accelerator.prepare(model, optimizer, loader)`` keeps the
loader as it is (it already shards per rank and batches), ``save_state`` saves its state with
the model's, and ``load_state`` continues with the exact next batch.

    python examples/accelerate_loop.py [WORKDIR]      # or: accelerate launch examples/accelerate_loop.py
"""

import os
import sys

import torch
from accelerate import Accelerator

from _common import TOKENIZER, corpus, tiny_llama, workdir
from tokenloom.recipes import pretrain


def train(out: str, steps: int, save_at=None, resume=False):
    accelerator = Accelerator()
    loader = pretrain(corpus(out), tokenizer=TOKENIZER, seq_len=64, batch_size=4, num_workers=2,
                      rank=accelerator.process_index, world_size=accelerator.num_processes)
    model = tiny_llama(64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    if resume:
        accelerator.load_state(os.path.join(out, "accelerate"))
    seen = []
    for batch in loader:
        # labels are already shifted: give them as shift_labels (labels= only switches the loss on)
        loss = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     shift_labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        seen.append(batch["input_ids"])
        if len(seen) % 4 == 0:  # the loader's figures, flat, for any tracker (init_trackers)
            accelerator.log(loader.figures(), step=len(seen))
            accelerator.print(f"step {len(seen)}:", {k: round(v, 4) for k, v in loader.figures().items()})
        if len(seen) == save_at:
            accelerator.save_state(os.path.join(out, "accelerate"))
        if len(seen) == steps:
            return seen


if __name__ == "__main__":
    out = workdir(sys.argv)
    first = train(out, 8, save_at=4)
    again = train(out, 4, resume=True)   # in your job: a new process after a preemption
    same = all(torch.equal(a, b) for a, b in zip(first[4:], again))
    print(f"steps 5-8 after load_state equal the uninterrupted run's: {same}")

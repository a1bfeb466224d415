"""torchtitan with tokenloom's loader: `TitanLoader` is a torchtitan ``BaseDataLoader`` (batches
as ``({"input": ids, "positions": position_ids}, labels)``; its state is the per-rank entry
torchtitan's DCP checkpointer saves). In a torchtitan trainer, return it where the trainer builds
its dataloader:

    dataloader = TitanLoader(pretrain(files, tokenizer=..., seq_len=job.training.seq_len,
                                      batch_size=job.training.local_batch_size,
                                      rank=dp_rank, world_size=dp_degree, num_workers=2),
                             dp_rank, dp_degree)

On another data-parallel degree, leave the dataloader out of torchtitan's load
(``checkpoint.exclude_from_loading = ["dataloader"]``) and call
``dataloader.load_elastic(step_folder)``. This script does torchtitan's save and load by hand
(``torch.distributed.checkpoint``) under torchrun:

    torchrun --nproc-per-node 2 examples/torchtitan_loader.py [WORKDIR]
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from _common import TOKENIZER, corpus
from tokenloom.integrations.torchtitan import TitanLoader
from tokenloom.recipes import pretrain


def batches(out: str, steps: int, save_at=None, resume=False):
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = TitanLoader(pretrain(corpus(out), tokenizer=TOKENIZER, seq_len=64, batch_size=4, num_workers=2,
                                  rank=rank, world_size=world), rank, world)
    ckpt = os.path.join(out, "titan-step-4")
    if resume:
        dcp.load({"dataloader": loader}, checkpoint_id=ckpt)
    seen = []
    for inputs, labels in loader:
        seen.append(inputs["input"])
        if len(seen) == save_at:
            dcp.save({"dataloader": loader}, checkpoint_id=ckpt)
        if len(seen) == steps:
            return seen


if __name__ == "__main__":
    dist.init_process_group("gloo")
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tokenloom-example-titan"  # the same on every rank
    if dist.get_rank() == 0:
        corpus(out)
    dist.barrier()
    first = batches(out, 8, save_at=4)
    again = batches(out, 4, resume=True)
    same = all(torch.equal(a, b) for a, b in zip(first[4:], again))
    print(f"rank {dist.get_rank()}: steps 5-8 after dcp.load equal the uninterrupted run's: {same}")
    dist.destroy_process_group()

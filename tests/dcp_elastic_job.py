"""One rank of the elastic DCP job that tests/test_torchrun.py launches with torchrun.

usage: dcp_elastic_job.py run|resume GLOB TOKENIZER OUT_DIR CKPT_DIR SAVE_STEP NUM_WORKERS

run:    (2 ranks) one finite epoch (epochs=1); after SAVE_STEP batches, save a model and the
        loader itself with ``dcp.save({"model": ..., "dataloader": loader})`` and stop. The
        batches received before the save go to OUT_DIR/before_rank<r>.pt.
resume: (any number of ranks, any NUM_WORKERS) the model through ``dcp.load``, the loader
        from every old rank's entry: ``loader.load_state_dict(read_loader_states(CKPT_DIR))``;
        the rest of the epoch goes to OUT_DIR/after_w<world size>_rank<r>.pt.
Each rank prints one JSON line.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tokenloom.pipes.loader.checkpoint import read_loader_states
from rank_common import build, finish


def main():
    mode, glob, tokenizer, out_dir, ckpt_dir, save_step, num_workers = sys.argv[1:]
    save_step, num_workers = int(save_step), int(num_workers)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = build(glob, tokenizer, num_workers)
    info = {"rank": rank, "world_size": loader.config["world_size"], "num_workers": num_workers}
    torch.manual_seed(100)
    model = torch.nn.Linear(8, 4)

    if mode == "run":
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == save_step:
                dcp.save({"model": model.state_dict(), "dataloader": loader}, checkpoint_id=ckpt_dir)
                break  # the job is preempted here
        torch.save(batches, os.path.join(out_dir, f"before_rank{rank}.pt"))
    else:
        state = {"model": model.state_dict()}
        dcp.load(state, checkpoint_id=ckpt_dir)
        model.load_state_dict(state["model"])
        old = read_loader_states(ckpt_dir)
        info["old_ranks"] = len(old)
        loader.load_state_dict(old)
        batches = list(loader)
        torch.save(batches, os.path.join(out_dir, f"after_w{world}_rank{rank}.pt"))
    finish(info, batches)


if __name__ == "__main__":
    main()

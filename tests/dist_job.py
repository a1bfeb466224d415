"""One rank of the two-rank job that tests/test_torchrun.py launches with torchrun.

usage: dist_job.py run|resume GLOB TOKENIZER OUT_DIR CKPT_DIR SAVE_STEP NUM_WORKERS [STITCHED_CKPT]

run:    one finite epoch (epochs=1). After SAVE_STEP batches, save a small model and
        the loader itself with torch.distributed.checkpoint, as a trainer writes it
        (``dcp.save({"model": ..., "dataloader": loader})``), and the loader's state
        with plain torch.save. Every batch goes to OUT_DIR/run_rank<r>.pt.
resume: with STITCHED_CKPT, first ``dcp.load`` from it (a checkpoint whose loader
        entries were stitched from both ranks) and record the refusal; then a fresh
        loader and a freshly initialised model, restored from CKPT_DIR with the same
        dict; the rest of the epoch goes to OUT_DIR/resume_rank<r>.pt.
Each rank prints one JSON line with what the test checks besides the batches.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tokenloom.pipes.loader.rank_sync import TorchDistSync
from rank_common import build, finish


def main():
    mode, glob, tokenizer, out_dir, ckpt_dir, save_step, num_workers, *stitched = sys.argv[1:]
    save_step, num_workers = int(save_step), int(num_workers)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = build(glob, tokenizer, num_workers)
    info = {"rank": rank, "world_size": loader.config["world_size"], "loader_rank": loader.config["rank"],
            "sync": type(loader.rank_sync).__name__}
    assert isinstance(loader.rank_sync, TorchDistSync), info

    if mode == "run":
        torch.manual_seed(100)  # replicated weights, as under DDP: DCP writes one copy of "model.*"
        model = torch.nn.Linear(8, 4)
        batches = []
        for batch in loader:
            batches.append(batch)
            if len(batches) == save_step:
                dcp.save({"model": model.state_dict(), "dataloader": loader}, checkpoint_id=ckpt_dir)
                torch.save(loader.state_dict(), os.path.join(out_dir, f"plain_rank{rank}.pt"))
                torch.save(model.state_dict(), os.path.join(out_dir, f"model_rank{rank}.pt"))
                with torch.no_grad():  # the training goes on: the live weights move away from the saved ones
                    model.weight.add_(1.0)
        torch.save(batches, os.path.join(out_dir, f"run_rank{rank}.pt"))
        info["padding_batches"] = loader.stats()["rank_padding_batches"]
    else:
        model = torch.nn.Linear(8, 4)
        torch.nn.init.zeros_(model.weight)
        for path in stitched:
            try:
                dcp.load({"dataloader": loader}, checkpoint_id=path)
            except ValueError as e:  # raised by loader.load_state_dict, after DCP read the entries
                info["stitched_refused"] = str(e)
            else:
                info["stitched_refused"] = None
            # the same loader goes on to the real load: a refused state must leave it untouched
        state = {"model": model.state_dict(), "dataloader": loader}
        dcp.load(state, checkpoint_id=ckpt_dir)
        model.load_state_dict(state["model"])
        batches = list(loader)
        torch.save(batches, os.path.join(out_dir, f"resume_rank{rank}.pt"))
        torch.save(model.state_dict(), os.path.join(out_dir, f"model_resumed_rank{rank}.pt"))
    finish(info, batches)


if __name__ == "__main__":
    main()

"""One rank of the chained elastic DCP job that tests/test_torchrun.py launches for the oracle.

usage: oracle_dcp_job.py run|relay|resume CONFIG_JSON OUT_DIR CKPT_IN CKPT_OUT STEPS

run:    build the loader (CONFIG_JSON: pretrain keyword arguments, sources and tokenizer included),
        take STEPS batches, then ``dcp.save({"dataloader": loader}, CKPT_OUT)``.
relay:  load every old rank's entry of CKPT_IN (`read_loader_states`) and save at once to CKPT_OUT,
        before any step: a job restarted and checkpointed (or preempted again) before its first step.
resume: load every old rank's entry of CKPT_IN and run to the end of the round.
The batches a rank received go to OUT_DIR/<mode>_rank<r>.pt; each rank prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tokenloom.pipes.loader.checkpoint import read_loader_states
from tokenloom.recipes import pretrain


def main():
    mode, config, out_dir, ckpt_in, ckpt_out, steps = sys.argv[1:]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = pretrain(**json.loads(config))
    batches = []
    if mode != "run":
        loader.load_state_dict(read_loader_states(ckpt_in))
    if mode != "relay":
        for batch in loader:
            batches.append(batch)
            if mode == "run" and len(batches) == int(steps):
                break
    if mode != "resume":
        dcp.save({"dataloader": loader}, checkpoint_id=ckpt_out)
    torch.save(batches, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    info = {"rank": rank, "batches": len(batches)}
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()

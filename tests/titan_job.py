"""torchtitan's dataloader protocol under torchrun: one rank of the job test_integrations.py runs.

usage: titan_job.py run|resume|elastic CONFIG_JSON CKPT OUT STEPS K
run:     STEPS steps through `TitanLoader`, ``dcp.save({"dataloader": loader})`` after step K, as
         torchtitan's checkpointer does;
resume:  the same number of ranks, ``dcp.load({"dataloader": loader})``, STEPS - K steps;
elastic: any number of ranks, ``load_elastic(CKPT)``, to the end of the round.
Each rank writes what it got, (input, positions, labels) per step, to OUT_rank<r>.pt.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tokenloom.integrations.torchtitan import TitanLoader
from tokenloom.recipes import pretrain


def main():
    mode, config, ckpt, out, steps, k = sys.argv[1:]
    steps, k = int(steps), int(k)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    loader = TitanLoader(pretrain(**json.loads(config)), rank, world)
    if mode == "resume":
        dcp.load({"dataloader": loader}, checkpoint_id=ckpt)
    elif mode == "elastic":
        loader.load_elastic(ckpt)
    seen = []
    todo = {"run": steps, "resume": steps - k, "elastic": None}[mode]
    for input_dict, labels in loader:
        seen.append((input_dict["input"], input_dict["positions"], labels))
        if mode == "run" and len(seen) == k:
            dcp.save({"dataloader": loader}, checkpoint_id=ckpt)
        if todo is not None and len(seen) == todo:
            break
    torch.save(seen, f"{out}_rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "batches": len(seen)}), flush=True)


if __name__ == "__main__":
    main()

"""One rank of the two-rank job in tests/test_torchrun.py that saves while a rank pads.

usage: pad_resume_job.py run|resume GLOB TOKENIZER OUT_DIR NUM_WORKERS [STEP ...]

run:    two finite epochs (epochs=1, two ``for`` loops). After every batch of the first
        epoch, this rank's loader state goes to OUT_DIR/state_rank<r>_step<k>.pt; the
        batches of both epochs to OUT_DIR/run_rank<r>.pt.
resume: for each STEP, a fresh loader loads the state saved after STEP batches and runs the
        rest of that epoch and the next; the batches go to OUT_DIR/resume<STEP>_rank<r>.pt.
        The JSON line's "batches" is the rest's length after each STEP, {STEP: n}.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from tokenloom.recipes import pretrain


def main():
    mode, glob, tokenizer, out_dir, num_workers = sys.argv[1:6]
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def build():
        return pretrain(glob, tokenizer=tokenizer, seq_len=255, batch_size=4, buffer_size=32, epochs=1,
                        num_workers=int(num_workers), seed=11)

    if mode == "run":
        loader = build()
        first = []
        for batch in loader:
            first.append(batch)
            torch.save(loader.state_dict(), os.path.join(out_dir, f"state_rank{rank}_step{len(first)}.pt"))
        second = list(loader)
        torch.save([first, second], os.path.join(out_dir, f"run_rank{rank}.pt"))
        info = {"rank": rank, "batches": len(first)}
    else:
        info = {"rank": rank, "batches": {}}
        for step in map(int, sys.argv[6:]):
            loader = build()
            loader.load_state_dict(torch.load(os.path.join(out_dir, f"state_rank{rank}_step{step}.pt"),
                                              weights_only=True))
            rest = list(loader)
            second = list(loader)
            torch.save([rest, second], os.path.join(out_dir, f"resume{step}_rank{rank}.pt"))
            info["batches"][step] = len(rest)
            del loader
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(info), flush=True)


if __name__ == "__main__":
    main()

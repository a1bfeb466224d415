"""What the rank scripts tests/test_torchrun.py launches share (dist_job.py, dcp_elastic_job.py):
the loader every rank builds and how a rank ends. Imported by name: torchrun runs the scripts
with tests/ first on ``sys.path``."""

from __future__ import annotations

import json

import torch.distributed as dist

from tokenloom.recipes import pretrain


def build(glob, tokenizer, num_workers):
    # rank, world_size and (epochs=1) the rank sync come from torch.distributed; rows of 127 tokens
    # hold every document of the test's corpus, so no document is cut (test_torchrun._doc_ids)
    return pretrain(glob, tokenizer=tokenizer, seq_len=127, batch_size=4, buffer_size=32, epochs=1,
                    num_workers=num_workers, seed=5)


def finish(info, batches):
    """Count ``batches`` into ``info``, wait for every rank, and print ``info`` as this rank's JSON line."""
    info["batches"] = len(batches)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps(info), flush=True)

"""A training job that tests/test_preemption.py kills with SIGKILL and resumes.

usage: preempt_job.py GLOB TOKENIZER STATE_FILE LOG_FILE TOTAL SAVE_EVERY

Runs `pretrain(..., num_workers=2)` until step TOTAL. If STATE_FILE exists it
resumes from it (``torch.load(weights_only=True)``). Per batch, in this order:
append ``"<step> <digest>"`` to LOG_FILE (flushed, so a SIGKILL loses nothing
written before it), every SAVE_EVERY steps write ``{"step", "loader"}`` to
STATE_FILE atomically (a temporary file, fsync, then ``os.replace``, so a kill
mid-write leaves the previous state intact), then print ``"step <n>"``.
"""

from __future__ import annotations

import hashlib
import os
import sys

import torch

from tokenloom.recipes import pretrain


def build(glob, tokenizer):
    return pretrain(glob, tokenizer=tokenizer, seq_len=127, batch_size=4, buffer_size=32, num_workers=2, seed=13)


def batch_digest(batch) -> str:
    """sha256 over every tensor's key, dtype, shape and bytes."""
    h = hashlib.sha256()
    for key in sorted(batch):
        t = batch[key].contiguous()
        h.update(f"{key}:{t.dtype}:{tuple(t.shape)}\n".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()[:32]


def save_atomically(obj, path):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main():
    glob, tokenizer, state_file, log_file, total, save_every = sys.argv[1:]
    total, save_every = int(total), int(save_every)
    loader = build(glob, tokenizer)
    step = 0
    if os.path.exists(state_file):
        saved = torch.load(state_file, weights_only=True)
        step = int(saved["step"])
        loader.load_state_dict(saved["loader"])
    print(f"start {step}", flush=True)
    with open(log_file, "a") as log:
        it = iter(loader)  # endless stream (epochs=None)
        while step < total:
            batch = next(it)
            step += 1
            log.write(f"{step} {batch_digest(batch)}\n")
            log.flush()
            if step % save_every == 0:
                save_atomically({"step": step, "loader": loader.state_dict()}, state_file)
            print(f"step {step}", flush=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()

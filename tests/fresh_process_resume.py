"""Run by test_fresh_process.py in a new interpreter: resume from a saved state.

usage: fresh_process_resume.py resume STATE_FILE OUT_FILE NUM_WORKERS STEPS [--buffer N] SOURCES...
(SOURCES: files of one source, or NAME=PATH for several sources, mixed; --buffer: buffer_size, default 1000)
"""

import sys

import torch

from tokenloom.recipes import pretrain
from tokenloom.sample_data import default_tokenizer_path


def build(sources, num_workers, buffer_size=1000):
    return pretrain(sources, tokenizer=default_tokenizer_path(), bos="<|bos|>", seq_len=512, batch_size=4,
                    num_workers=num_workers, seed=3, buffer_size=buffer_size)


def main():
    mode, state_file, out_file, num_workers, steps, *sources = sys.argv[1:]
    if mode != "resume":
        raise SystemExit(f"unknown mode {mode!r}; usage: {__doc__.split('usage: ')[1]}")
    buffer_size = 1000
    if sources[:1] == ["--buffer"]:
        buffer_size, sources = int(sources[1]), sources[2:]
    if all("=" in s for s in sources):
        sources = dict(s.split("=", 1) for s in sources)
    loader = build(sources, int(num_workers), buffer_size)
    loader.load_state_dict(torch.load(state_file, weights_only=True))
    it = iter(loader)
    batches = [next(it) for _ in range(int(steps))]
    torch.save(batches, out_file)


if __name__ == "__main__":
    main()

"""Run by tests/test_fork_safety.py in a fresh interpreter: the training process first uses a library's
threads (CASE), then a 2-worker loader reads one epoch. Prints one JSON line: a digest of every batch,
the batch count and the start method the workers got.

    python -m tests.fork_after_threads_job CASE CORPUS_GLOB TOKENIZER
CASE: none | fastokens | tokenizers | tiktoken | torch | pyarrow | others (the last four) | all
"""

from __future__ import annotations

import glob
import hashlib
import json
import sys


def use_threads(case: str, files: str, tokenizer: str) -> None:
    import pyarrow.parquet as pq

    texts = [t for f in sorted(glob.glob(files)) for t in pq.read_table(f).column("text").to_pylist()]
    texts = [t * 20 for t in texts[:96]]  # long documents: the engines split them over their threads
    if case in ("fastokens", "all"):
        import fastokens

        fastokens.Tokenizer.from_file(tokenizer).encode_batch(texts)
    if case in ("tokenizers", "others", "all"):
        from tokenizers import Tokenizer

        Tokenizer.from_file(tokenizer).encode_batch(texts)
    if case in ("tiktoken", "others", "all"):
        from tokenloom.pipes import tiktoken_bpe
        from tokenloom.pipes.tokenizer import load_encoder

        enc = load_encoder(tokenizer, engine="tiktoken")
        tiktoken_bpe.encode_batch(tiktoken_bpe.encoding(enc._payload), texts, threads=4)
    if case in ("torch", "others", "all"):
        import torch

        torch.set_num_threads(2)
        x = torch.randn(768, 768)
        for _ in range(20):
            x = torch.tanh(x @ x)
    if case in ("pyarrow", "others", "all"):
        for f in sorted(glob.glob(files)):
            pq.read_table(f, use_threads=True)


def main() -> None:
    case, files, tokenizer = sys.argv[1:4]
    use_threads(case, files, tokenizer)
    from tokenloom.recipes import pretrain

    loader = pretrain(files, tokenizer=tokenizer, seq_len=255, batch_size=4, num_workers=2, epochs=1, seed=3,
                      stall_timeout=60)
    digest, n = hashlib.sha256(), 0
    for batch in loader:
        for key in sorted(batch):
            digest.update(key.encode())
            digest.update(batch[key].numpy().tobytes())
        n += 1
    print(json.dumps({"digest": digest.hexdigest(), "batches": n,
                      "start_method": loader.multiprocessing_context.get_start_method()}))


if __name__ == "__main__":
    main()

"""One thread of tokenizing per loader worker: the workers are the parallelism.

A Hugging Face tokenizer's batched call spreads its documents over a Rayon thread
pool as large as the machine. In the training process (``num_workers=0``) that
is what makes it fast. In a loader worker it is oversubscription: with as many
workers as cores, each worker's pool adds a thread per core, and their idle
threads spin while waiting for work, taking cycles from the other workers, so
the same work costs more CPU per token than with one thread per worker
(``pretrain`` with one thread per worker against the pools: see docs/performance.md).

So each worker sets ``TOKENIZERS_PARALLELISM=false`` (read by the tokenizers
library at each batched call), and fastokens' ``FASTOKENS_BPE_THREADS=1`` and
``RAYON_NUM_THREADS=1`` (fastokens_engine.py), before it tokenizes anything. It applies only in
worker processes, which tokenloom owns. A user who runs fewer workers than cores
and wants the pools back sets the variable to ``true`` in their
``worker_init_fn``, which runs after this. (tiktoken encodes a batch on a pool of
Python threads that sleep when idle; it is left as it is.)
"""

from __future__ import annotations

import os

TOKENIZERS_PARALLELISM = "TOKENIZERS_PARALLELISM"


def single_thread_tokenizers() -> None:
    """Make this process's Hugging Face tokenizers and fastokens encode on one thread only."""
    from .fastokens_engine import single_thread

    os.environ[TOKENIZERS_PARALLELISM] = "false"
    single_thread()

"""What the examples share: a small corpus (prose from the Python standard library as parquet,
written once), the shipped demo tokenizer, and a tiny random Llama, so each example runs on a
laptop CPU in seconds. Swap in your files, tokenizer and model."""

from __future__ import annotations

import os
import tempfile

import torch

from tokenloom.pipes import load_encoder
from tokenloom.sample_data import default_tokenizer_path, stdlib_documents, write_parquet_corpus

TOKENIZER = default_tokenizer_path()


def corpus(out_dir: str) -> str:
    """A glob of parquet files (300 documents), written under ``out_dir`` if not there yet."""
    data = os.path.join(out_dir, "corpus")
    if not os.path.isdir(data):
        write_parquet_corpus(data, stdlib_documents("prose", limit=300), rows_per_file=100)
    return os.path.join(data, "*.parquet")


def workdir(argv) -> str:
    return argv[1] if len(argv) > 1 else tempfile.mkdtemp(prefix="tokenloom-example-")


def tiny_llama(seq_len: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=load_encoder(TOKENIZER).vocab_size, hidden_size=32,
                                        intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=2, max_position_embeddings=seq_len))

"""What the trainer jobs (tests/*_job.py, run in fresh processes by tests/test_integrations.py)
share: the corpus, the loader, a tiny random Llama (the Hugging Face Trainer's job) and a tinier
LM (the other trainers'). Imported by name: the jobs run with tests/ first on ``sys.path``."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from tokenloom.recipes import pretrain

SEQ_LEN, BATCH, WORKERS = 32, 2, 2


def build_loader(glob: str, tokenizer: str, **kw):
    return pretrain(glob, tokenizer=tokenizer, seq_len=SEQ_LEN, batch_size=BATCH, buffer_size=16, seed=3,
                    num_workers=WORKERS, **kw)


class TinyLM(torch.nn.Module):
    """A causal LM of an embedding and a projection, called as a Hugging Face one is (``loss_of``): what
    the trainers other than Hugging Face's own need of a model, without importing transformers (seconds
    per job process). The batches a step gets do not depend on the model."""

    def __init__(self, vocab_size: int = 4096, width: int = 16):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab_size, width)
        self.out = torch.nn.Linear(width, vocab_size)

    def forward(self, input_ids, position_ids=None, labels=None, shift_labels=None):
        logits = self.out(self.embed(input_ids))
        targets = shift_labels if shift_labels is not None else labels
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        return SimpleNamespace(loss=loss, logits=logits)


def tiny_llama(vocab_size: int = 4096):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ_LEN)
    return LlamaForCausalLM(config)


def loss_of(model, batch):
    """The README's loss for a Hugging Face causal LM: labels are already shifted."""
    return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                 shift_labels=batch["labels"]).loss


def record(out_path: str, seen) -> None:
    """The input ids of the batches a training step got, in order, as lists (JSON)."""
    with open(out_path, "w") as f:
        json.dump([b.tolist() for b in seen], f)


def read(out_path: str):
    with open(out_path) as f:
        return json.load(f)


def here(*parts: str) -> str:
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), *parts)

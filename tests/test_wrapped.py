"""A loader that survives being wrapped (issue 25): frameworks re-create a DataLoader around
``loader.dataset`` with the loader's arguments (Accelerate's DataLoaderShard/Dispatcher, a
trainer's own StatefulDataLoader subclass). What such a loader yields must be the public
batch dicts, the very batches tokenloom's loader yields: never a wire object, no private key.
"""

from __future__ import annotations

import pickle

import pytest
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from tokenloom.recipes import pretrain

from .resume import items_equal

KEYS = {"input_ids", "labels", "position_ids", "segment_ids", "cu_seqlens", "max_seqlen", "num_seqs"}


def _build(corpus, tok_path, workers):
    return pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=1,
                    num_workers=workers, epochs=1)


@pytest.mark.parametrize("cls", [DataLoader, StatefulDataLoader])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_recreated_around_the_dataset_yields_the_public_batches(corpus, tok_path, cls, workers):
    loader = _build(corpus, tok_path, workers)
    want = list(loader)
    # What Accelerate's prepare_data_loader does: a new loader over .dataset with the old one's arguments.
    kwargs = {k: getattr(loader, k) for k in ("num_workers", "collate_fn", "pin_memory", "worker_init_fn",
                                              "multiprocessing_context", "prefetch_factor", "persistent_workers")
              if workers or k not in ("prefetch_factor", "persistent_workers")}
    again = _build(corpus, tok_path, workers)
    got = list(cls(again.dataset, batch_size=None, **kwargs))
    assert len(got) == len(want) > 3
    for k, (a, b) in enumerate(zip(got, want)):
        assert isinstance(a, dict) and set(a) == KEYS, f"batch {k}: keys {sorted(a)}"
        assert items_equal(dict(a), b), f"batch {k} differs from the loader's"
        # what a user saves and loads as plain data
        assert set(torch.load(_saved(a), weights_only=True)) == KEYS


def _saved(batch):
    import io

    buf = io.BytesIO()
    torch.save(batch, buf)
    buf.seek(0)
    return buf


def test_the_loaders_own_batches_are_plain_dicts(corpus, tok_path):
    loader = _build(corpus, tok_path, 2)
    batch = next(iter(loader))
    assert type(batch) is dict and set(batch) == KEYS
    assert type(pickle.loads(pickle.dumps(batch))) is dict

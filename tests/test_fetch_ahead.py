"""A loader iterated by Lightning's fetch-ahead fetcher saves the state of the batch being trained on
(pipes/loader/fetch_ahead.py); the real trainers' runs are in test_integrations.py."""

from __future__ import annotations

import pytest
import torch

from tokenloom.pipes.loader import fetch_ahead
from tokenloom.pipes.loader.fetch_ahead import FetchAhead

from tokenloom.recipes import pretrain

from .trainer_common import BATCH, SEQ_LEN


def build_loader(glob, tokenizer):
    """The trainers' loader (trainer_common.py) without workers: nothing outlives a test."""
    return pretrain(glob, tokenizer=tokenizer, seq_len=SEQ_LEN, batch_size=BATCH, buffer_size=16, seed=3)


def _fetched(loader, package: str):
    """Lightning's own fetcher over ``loader``, as its fit loop sets it up."""
    fetchers = pytest.importorskip(f"{package}.loops.fetchers")
    combined = pytest.importorskip(f"{package}.utilities.combined_loader")
    fetcher = fetchers._PrefetchDataFetcher()
    fetcher.setup(combined.CombinedLoader(loader, "max_size_cycle"))
    iter(fetcher)
    return fetcher


def _same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("package", ["lightning.pytorch", "pytorch_lightning"])
def test_the_state_is_the_one_of_the_batch_being_trained_on(corpus, tok_path, package):
    want = [b for _, b in zip(range(8), build_loader(corpus[0], tok_path))]
    loader = build_loader(corpus[0], tok_path)
    fetcher = _fetched(loader, package)
    assert len(fetcher.batches) == 1  # one batch fetched ahead of the first step
    for _ in range(4):
        next(fetcher)  # the step trains on it; the fetcher holds the next one
    state = loader.state_dict()
    resumed = build_loader(corpus[0], tok_path)
    resumed.load_state_dict(state)
    got = [b for _, b in zip(range(4), resumed)]
    assert all(_same(a, b) for a, b in zip(got, want[4:8])), "the resume does not start at step 5"


def test_without_lightnings_fetcher_nothing_is_kept(corpus, tok_path, monkeypatch):
    """The fallback: where Lightning's fetcher is not found (another release renames it, or another
    loop iterates), the loader saves its own position, as a plain training loop expects."""
    loader = build_loader(corpus[0], tok_path)
    it = iter(loader)
    assert loader.fetch_ahead is None
    next(it)
    assert FetchAhead.find() is None
    pytest.importorskip("lightning.pytorch.loops.fetchers")
    monkeypatch.setattr(fetch_ahead, "FETCHER_CLASS", "_RenamedFetcher")
    assert fetch_ahead.fetcher_classes() == ()
    fetcher = _fetched(build_loader(corpus[0], tok_path), "lightning.pytorch")
    for _ in range(3):
        next(fetcher)
    assert fetcher.combined_loader.flattened[0].fetch_ahead is None


def test_lightnings_fetcher_still_has_what_is_read_of_it():
    """A Lightning release that renames the class or its ``batches`` list turns the exact resume of
    a loader passed as train_dataloader() back into one a batch late: this names the change."""
    fetchers = pytest.importorskip("lightning.pytorch.loops.fetchers")
    assert fetch_ahead.fetcher_classes(), f"{fetch_ahead.FETCHER_CLASS} is gone from {fetchers.__name__}"
    assert isinstance(fetchers._PrefetchDataFetcher().batches, list)


def test_looking_for_the_fetcher_keeps_nothing_alive(corpus, tok_path):
    """Reading a frame's locals snapshots them into the frame: done for every caller, the test's own
    frame kept a dropped loader (and its workers) alive until the cyclic gc ran. Only the fetcher's
    own frames are read."""
    import gc
    import weakref

    pytest.importorskip("lightning.pytorch.loops.fetchers")
    assert fetch_ahead.fetcher_classes()
    gc.disable()
    try:
        loader = build_loader(corpus[0], tok_path)
        it = iter(loader)
        next(it)
        ref = weakref.ref(loader)
        del it, loader
        assert ref() is None, "the loader outlived its last reference"
    finally:
        gc.enable()

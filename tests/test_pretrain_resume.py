"""pretrain(): exact resume with 0-3 workers, snapshot intervals, epoch boundaries and rounds."""

from __future__ import annotations

import pytest
import torch

from tokenloom.recipes import pretrain
from tokenloom.pipes.loader.bridge import decode_state

from .resume import check_loader_resume, items_equal


def build(corpus, tok_path, **kw):
    glob, _ = corpus
    args = dict(seq_len=63, batch_size=2, buffer_size=40, seed=7)
    args.update(kw)
    return lambda: pretrain(glob, tokenizer=tok_path, **args)


# Snapshot intervals only exist for worker processes.
@pytest.mark.parametrize("num_workers,snapshot", [(0, None), (1, 1), (1, 3), (2, 1), (2, 3), (3, 1), (3, 3)])
def test_resume_mid_stream(corpus, tok_path, num_workers, snapshot):
    kw = dict(num_workers=num_workers)
    if snapshot is not None:
        kw["snapshot_every_n_steps"] = snapshot
    check_loader_resume(build(corpus, tok_path, **kw), steps=[1, 4, 11], total=18)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_across_epoch_boundaries_of_an_endless_stream(tmp_path, tok_path, num_workers):
    """A tiny corpus: one epoch is a few batches, so saves land before, on and after
    the boundaries where the reader starts a new epoch (and the packer's buffer spans two)."""
    from .conftest import synthetic_texts, write_corpus

    write_corpus(str(tmp_path), synthetic_texts(120, seed=4), files=2, row_group_size=16)
    b = lambda: pretrain(str(tmp_path / "*.parquet"), tokenizer=tok_path, seq_len=255, batch_size=4,
                         buffer_size=16, num_workers=num_workers, seed=2)
    one_epoch = len(list(pretrain(str(tmp_path / "*.parquet"), tokenizer=tok_path, seq_len=255, batch_size=4,
                                  buffer_size=16, num_workers=num_workers, seed=2, epochs=1)))
    assert 3 <= one_epoch <= 30
    steps = sorted({max(1, one_epoch - 1), one_epoch, one_epoch + 1, 2 * one_epoch, 2 * one_epoch + 1})
    check_loader_resume(b, steps=steps, total=3 * one_epoch)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("packing", ["flat", "bestfit"])
def test_resume_finite_epoch_to_the_end(corpus, tok_path, num_workers, packing):
    """epochs=1: resumes near the end and exactly at the last batch finish identically."""
    b = build(corpus, tok_path, num_workers=num_workers, packing=packing, epochs=1, batch_size=8)
    ref = list(b())
    n = len(ref)
    assert n > 20
    check_loader_resume(b, steps=[n // 2, n - 1, n], reference=ref)


def test_next_round_after_a_finished_epoch(corpus, tok_path):
    """A finished `for` loop: the next iter() is a new epoch with a new order, not a repeat
    or an empty epoch; a state saved after the loop resumes into that next epoch (1437)."""
    b = build(corpus, tok_path, epochs=1, batch_size=8)
    loader = b()
    first = list(loader)
    state = loader.state_dict()
    second = list(loader)
    assert len(second) > 0 and not items_equal(first[0], second[0])
    resumed = b()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(second)
    assert all(items_equal(x, y) for x, y in zip(again, second))


@pytest.mark.parametrize("persistent", [False, True])
def test_rounds_agree_across_worker_modes(corpus, tok_path, persistent):
    """Two epochs via two for-loops give the same batches with 0 workers and with 2 workers
    (persistent or not) up to the interleaving of the two workers' shards."""
    b = build(corpus, tok_path, epochs=1, batch_size=8, num_workers=2, persistent_workers=persistent)
    loader = b()
    e1, e2 = list(loader), list(loader)
    assert len(e1) > 0 and len(e2) > 0
    assert not items_equal(e1[0], e2[0])
    # the same loader, rebuilt, gives the same two epochs
    loader = b()
    assert all(items_equal(x, y) for x, y in zip(list(loader) + list(loader), e1 + e2))


def test_break_and_reiterate_restarts_the_round(corpus, tok_path):
    b = build(corpus, tok_path, epochs=1, batch_size=8)
    loader = b()
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    again = [next(iter(loader)) for _ in range(1)]
    assert items_equal(first[0], again[0])


def test_state_is_plain_and_small(corpus, tok_path):
    import pickle

    sizes = {}
    for buffer_size in (10, 500):
        loader = build(corpus, tok_path, num_workers=2, buffer_size=buffer_size)()
        it = iter(loader)
        for _ in range(6):
            next(it)
        state = decode_state(loader.state_dict())
        for w, ws in state["loader"]["_snapshot"]["_worker_snapshots"].items():
            sizes[(buffer_size, w)] = len(pickle.dumps(ws))
    assert max(sizes.values()) < 16_000, sizes

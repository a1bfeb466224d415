"""Rounds at their edges: saving while a rank pads, a peek before the loop with persistent
workers, and iterators made stale by a newer ``iter(loader)``.

Each case once went on silently with the wrong data (issue 14): a rank that saved while
padding resumed into the next epoch, a peek made the first ``for`` a repeat of the
wrong epoch, and an old iterator kept yielding beside a new one.
"""

from __future__ import annotations

import threading

import pytest

from tokenloom.pipes.loader.rank_sync import ThreadSync
from tokenloom.recipes import multiplex, pretrain

from .resume import items_equal, torch_roundtrip


def _in_threads(job, world_size=2, timeout=300):
    out, errors = {}, {}

    def run(rank):
        try:
            out[rank] = job(rank)
        except BaseException as e:  # noqa: BLE001 - reported below with the rank
            errors[rank] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if errors:
        rank, e = sorted(errors.items())[0]
        raise AssertionError(f"rank {rank} failed: {type(e).__name__}: {e}") from e
    assert set(out) == set(range(world_size)), "a rank did not finish (hang)"
    return out


def _is_padding(batch) -> bool:
    return int((batch["labels"] != -100).sum()) == 0


def _same(a, b) -> bool:
    return len(a) == len(b) and all(items_equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_ranks_resume_while_padding_and_at_the_last_step(corpus, tok_path, num_workers):
    glob, _ = corpus

    def build(rank, sync):
        return pretrain(glob, tokenizer=tok_path, seq_len=255, batch_size=4, epochs=1, rank=rank, world_size=2,
                        num_workers=num_workers, rank_sync=sync, seed=11)

    sync = ThreadSync(2)

    def uninterrupted(rank):
        loader = build(rank, sync)
        return [list(loader), list(loader)]  # two passes: the second for is the next epoch

    full = _in_threads(uninterrupted)
    assert len(full[0][0]) == len(full[1][0]) and len(full[0][1]) == len(full[1][1])
    n = len(full[0][0])
    pads = [[i for i, b in enumerate(full[r][0]) if _is_padding(b)] for r in (0, 1)]
    padding_rank = 0 if pads[0] else 1
    assert pads[padding_rank], "this corpus must make one rank pad"
    first_pad = pads[padding_rank][0]
    assert first_pad < n - 1, "the padding rank must pad for more than the last step"

    for k in (first_pad + 1, n - 1, n):  # after the first padding batch, before the last step, after it
        save_sync = ThreadSync(2)

        def first_part(rank, k=k, save_sync=save_sync):
            loader = build(rank, save_sync)
            it = iter(loader)
            got = [next(it) for _ in range(k)]
            return got, torch_roundtrip(loader.state_dict())

        saved = _in_threads(first_part)
        resume_sync = ThreadSync(2)

        def second_part(rank, saved=saved, resume_sync=resume_sync):
            loader = build(rank, resume_sync)
            loader.load_state_dict(saved[rank][1])
            return [list(loader), list(loader)]

        resumed = _in_threads(second_part)
        for rank in (0, 1):
            assert _same(saved[rank][0], full[rank][0][:k])
            rest, following = resumed[rank]
            assert len(rest) == n - k, (f"rank {rank}, saved after {k} of {n} steps: {len(rest)} batches came "
                                        f"after the resume, the uninterrupted epoch had {n - k} left")
            assert _same(rest, full[rank][0][k:]), f"rank {rank}, saved after step {k}: the rest of the epoch differs"
            assert _same(following, full[rank][1]), f"rank {rank}, saved after step {k}: the next epoch differs"


@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True])
def test_a_peek_then_for_means_the_same_with_and_without_persistent_workers(corpus, tok_path, persistent):
    glob, _ = corpus
    # A big prefetch: every worker reaches its shard's end while the peek's iterator is alive.
    reference = pretrain(glob, tokenizer=tok_path, seq_len=255, batch_size=8, epochs=1, num_workers=2, seed=3)
    epoch0, epoch1 = list(reference), list(reference)
    assert len(epoch0) < 2 * 64, "the epoch must fit in the workers' ready batches"

    loader = pretrain(glob, tokenizer=tok_path, seq_len=255, batch_size=8, epochs=1, num_workers=2, seed=3,
                      persistent_workers=persistent, prefetch_factor=64)
    peek = next(iter(loader))
    assert items_equal(peek, epoch0[0])
    first_for = list(loader)
    assert _same(first_for, epoch0), "after a peek, the first for loop restarts the current epoch"
    state = torch_roundtrip(loader.state_dict())
    second_for = list(loader)
    assert _same(second_for, epoch1), "the next for loop is the next epoch"

    resumed = pretrain(glob, tokenizer=tok_path, seq_len=255, batch_size=8, epochs=1, num_workers=2, seed=3,
                       persistent_workers=persistent, prefetch_factor=64)
    resumed.load_state_dict(state)
    assert _same(list(resumed), epoch1), "a state saved after a finished loop resumes into the next epoch"


@pytest.mark.slow
def test_multiplex_peek_with_persistent_workers():
    data = [("a", [{"x": i} for i in range(40)]), ("b", [{"x": 100 + i} for i in range(24)])]

    def build(persistent):
        return multiplex(datasets=data, batch_size=4, num_workers=2, persistent_workers=persistent,
                         prefetch_factor=16, shuffle=True, shuffle_seed=5)

    reference = build(False)
    epoch0, epoch1 = list(reference), list(reference)
    loader = build(True)
    next(iter(loader))
    assert _same(list(loader), epoch0)
    assert _same(list(loader), epoch1)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_made_stale_by_a_new_iter_refuses_to_continue(corpus, tok_path, num_workers):
    glob, _ = corpus
    loader = pretrain(glob, tokenizer=tok_path, seq_len=127, batch_size=2, num_workers=num_workers, seed=1)
    old = iter(loader)
    next(old)
    new = iter(loader)
    first = next(new)
    with pytest.raises(RuntimeError, match="iter"):
        next(old)
    reference = pretrain(glob, tokenizer=tok_path, seq_len=127, batch_size=2, num_workers=num_workers, seed=1)
    ref = iter(reference)
    assert items_equal(first, next(ref))
    assert items_equal(next(new), next(ref)), "the newest iterator goes on undisturbed"


def test_in_order_false_is_refused_with_the_reason(corpus, tok_path):
    glob, _ = corpus
    with pytest.raises(ValueError, match=r"in_order=False is not supported.*resume is not exact"):
        pretrain(glob, tokenizer=tok_path, seq_len=127, batch_size=2, num_workers=2, in_order=False)
    pretrain(glob, tokenizer=tok_path, seq_len=127, batch_size=2, num_workers=2, in_order=True)  # the default is fine

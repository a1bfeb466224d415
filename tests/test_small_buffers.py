"""Every legal buffer size ends its epoch and trains on data (issue 34).

Several sources with ``buffer_size`` 1-3 looped for ever on rows of nothing but padding under
``bestfit`` (documents arriving in pieces filled the buffer with slots that cannot be placed),
and hung two ranks in their agreement on the round's end. Here every packing mode, 0 and 2
workers, 1 and 2 ranks run a whole epoch under a time limit, read by the token-level oracle
(tests/oracle.py): every document token delivered once, and a row of nothing but padding only
in the batch where a worker's data ends, or as a padding batch after a rank's data ended.
"""

from __future__ import annotations

import pytest

from .oracle import BOS, Hop, Oracle, make_corpus, run_chain
from .test_oracle import builder

T = 32
#: Seconds an epoch may take here (each takes 1-3 s): past it, the epoch does not end.
LIMIT = 60


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("small_buffers")
    specs = {2: {"a": ("parquet", 40), "b": ("jsonl", 30)},
             3: {"a": ("jsonl_gz", 30), "b": ("json_array", 25), "c": ("parquet", 30)}}
    return {n: make_corpus(str(root / str(n)), spec, row=T + 1, seed=n) for n, spec in specs.items()}


@pytest.mark.parametrize("packing", ["bestfit", "flat", "bestfit-crop"])
@pytest.mark.parametrize("buffer_size", [1, 2, 3])
@pytest.mark.parametrize("n_sources", [2, 3])
def test_every_buffer_size_ends_its_epoch_with_data_in_every_row(corpora, n_sources, buffer_size, packing):
    corpus = corpora[n_sources]
    weights = {n: 1 + i for i, n in enumerate(corpus.sources)}
    build = builder(corpus, seq_len=T, batch_size=4, packing=packing, buffer_size=buffer_size, weights=weights,
                    predict_bos=True)
    for world, workers in ((1, 0), (1, 2), (2, 0), (2, 2)):
        oracle = Oracle(corpus, epochs=1, mode=packing, end_label=BOS)
        run_chain(build, [Hop(world, workers, None)], oracle, limit=LIMIT)
        oracle.finish()
        assert oracle.rows > 0


def test_the_demo_corpus_with_a_buffer_of_two_ends_its_epoch(demo_corpus):
    """The issue's own case: two sources of the demo corpus, buffer_size=2, one epoch. It gave 45,000
    batches in 15 s and went on; buffer_size=3 ends at ~3,400."""
    from tokenloom.recipes import pretrain

    sources = {k: demo_corpus[k] for k in ("code", "prose")}
    loader = pretrain(sources, tokenizer="demo", weights={"code": 1, "prose": 1},
                      seq_len=512, batch_size=4, buffer_size=2, epochs=1, num_workers=0)
    padded = None
    for n, batch in enumerate(loader):
        assert n < 6000, "the epoch did not end"
        assert padded is None, f"batch {padded} had a row of nothing but padding, and batch {n} came after it"
        data = (batch["segment_ids"] != 0).any(dim=1)
        if not data.all():  # only the last batch, and only after its rows with data
            assert not data[int((~data).nonzero()[0]):].any(), f"batch {n}: a row of padding before data"
            padded = n
    assert n > 3000


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
@pytest.mark.parametrize("buffer_size", [1, 2])
def test_a_buffer_smaller_than_the_sources_resumes_exactly_at_any_step(corpora, buffer_size, num_workers):
    """The shared resume helper over issue 34's setting: saved at steps spread over the epoch, through
    torch.save, resumed into a fresh loader, the rest equal to the uninterrupted run's."""
    from .resume import check_loader_resume

    corpus = corpora[2]
    build = builder(corpus, seq_len=T, batch_size=4, buffer_size=buffer_size, weights={"a": 1, "b": 2},
                    predict_bos=True)
    ref = check_loader_resume(lambda: build(0, 1, num_workers, None), steps=[1, 4, 11])
    assert len(ref) > 11


@pytest.mark.parametrize("packing", ["bestfit", "flat", "bestfit-crop"])
@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_smallest_legal_values_end_their_epoch(tmp_path, packing, num_workers):
    """One document per source, rows of 2 tokens (seq_len=1), one row a batch, a buffer of one document:
    one source and two; the epoch ends and the oracle sees every token once."""
    for spec in ({"a": ("parquet", 1)}, {"a": ("jsonl", 1), "b": ("parquet", 1)}):
        corpus = make_corpus(str(tmp_path / f"{len(spec)}-{packing}-{num_workers}"), spec, row=2, seed=len(spec))
        build = builder(corpus, seq_len=1, batch_size=1, packing=packing, buffer_size=1, predict_bos=True)
        oracle = Oracle(corpus, epochs=1, mode=packing, end_label=BOS)
        run_chain(build, [Hop(1, num_workers, None)], oracle, limit=LIMIT)
        oracle.finish()
        assert oracle.rows > 0


def test_a_step_that_never_returns_fails_within_the_time_limit():
    """The harness's limit holds for a next() that never returns (a graph reading for ever inside one
    step, as a filter that drops everything in an endless branch does): every rank together is bounded,
    not each in turn (four ranks waited 4 x 240 s before)."""
    import threading
    import time

    from tokenloom.pipes.loader.rank_sync import ThreadSync

    from .test_elastic import run_ranks

    never = threading.Event()

    class Stuck:
        def __iter__(self):
            return self

        def __next__(self):
            never.wait(60)
            raise StopIteration

        def state_dict(self):
            return {}

        def stats(self):
            return {}

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="did not finish"):
        run_ranks([Stuck() for _ in range(4)], ThreadSync(4), deadline=time.monotonic() + 1)
    assert time.monotonic() - t0 < 15
    never.set()

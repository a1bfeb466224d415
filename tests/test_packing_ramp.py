"""The best-fit buffer's ramp and token bound (issue 16 item 3), and crop's rule for long documents (item 5).

Tokens are unique integers (as in test_packing_properties.py), so rows say exactly which
document and position each token came from.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tokenloom.pipes import BestFitPack
from tokenloom.pipes.pack import _packcore_py
from tokenloom.pipes.pack import core as pack_core
from tokenloom.pipes.sources.memory import FromList

from .resume import check_node_resume
from .test_packing_properties import Watched, make_docs, positions, run, run_watched, segments

PAD = -1
# short documents and documents several rows long, as in real corpora
lengths_st = st.lists(st.one_of(st.integers(1, 12), st.integers(13, 80), st.integers(81, 300)), min_size=1,
                      max_size=50)


def with_core(packer: BestFitPack, core) -> BestFitPack:
    """Run ``packer`` on ``core`` (the C extension or its Python twin), also after a reset."""
    orig = packer._clear

    def clear():
        orig()
        packer._slots.core = core
    packer._clear = clear
    clear()
    return packer


@settings(max_examples=60, deadline=None)
@given(lengths=lengths_st, seq_len=st.integers(4, 40), buffer_size=st.integers(1, 30),
       rows=st.integers(1, 4), mode=st.sampled_from(["bestfit", "crop"]), ramp=st.booleans())
def test_token_bound_and_ramp_lose_nothing_and_resume_exactly(lengths, seq_len, buffer_size, rows, mode, ramp):
    C = seq_len + 1
    docs = make_docs(lengths)

    def build():
        return BestFitPack(FromList(docs), seq_len=seq_len, buffer_size=buffer_size, pad_id=PAD, mode=mode,
                           buffer_tokens=rows * C, ramp=ramp)

    packer = build()
    out = run(packer)
    where = positions(docs)
    seen = [int(t) for row in out for seg in segments(row)[0] for t in seg]
    assert len(seen) == len(set(seen)), "a token was emitted twice"
    stats = packer.stats()
    if mode == "bestfit":
        assert sorted(seen) == sorted(where), "every token comes out exactly once"
    else:
        assert len(seen) + stats["discarded"] == sum(lengths)
        source = Watched(docs)
        watched, after_end = run_watched(BestFitPack(source, seq_len=seq_len, buffer_size=buffer_size, pad_id=PAD,
                                                     mode=mode, buffer_tokens=rows * C, ramp=ramp), source)
        for r, row in enumerate(watched[:-1]):
            # crop pads only the rows it builds once upstream has ended (issue 42), and a label slot after
            # a whole document (issue 42: a document placed there would be its BOS alone, a target only)
            filled = int(row.seg_lens.sum())
            d, o = where[int(row.tokens[filled - 1])]
            assert after_end[r + 1] or filled == C or (filled == C - 1 and o == lengths[d] - 1), \
                f"crop pads row {r} before upstream ended"
        begun = {where[int(row.tokens[p])][0] for row in out for p in (np.cumsum(row.seg_lens) - row.seg_lens)
                 if p < C - 1}
        assert begun == set(range(len(docs))), "every document begins, its BOS an input"
    # exact resume from every step (the first 200), ramp and token bound included
    assert check_node_resume(build, max_steps=200, horizon=3) == min(len(out), 200)


def test_first_row_does_not_wait_for_a_full_buffer():
    """The first row needs about one row of tokens, not ``buffer_size`` documents; after that the
    buffer grows with the rows emitted, up to ``buffer_tokens``. Before the ramp the packer pulled
    all 1000 documents (here ~80 rows' worth) before its first row."""
    rng = np.random.default_rng(0)
    seq_len, C = 255, 256
    lengths = rng.integers(2, 40, 20_000)
    upstream = FromList(make_docs(lengths))
    packer = BestFitPack(upstream, seq_len=seq_len, buffer_size=1000)
    packer.reset(None)
    longest = int(lengths.max())
    emitted = int(next(packer).seg_lens.sum())
    assert int(lengths[:upstream._i].sum()) <= 2 * C + longest, f"the first row pulled {upstream._i} documents"
    for r in range(1, 300):
        emitted += int(next(packer).seg_lens.sum())
        held = int(lengths[:upstream._i].sum()) - emitted
        # before row r the buffer was filled to fill_limit (one document may cross it); the row then
        # took what it placed and topped up at most once more by as much
        limit = min(packer.buffer_tokens, (BestFitPack.RAMP_START + r // BestFitPack.RAMP_EVERY) * C)
        assert held <= limit + C + longest, (r, held, limit)
    assert packer._held >= packer.buffer_tokens - C, "the ramp reaches buffer_tokens"


def test_resume_window_is_bounded_in_tokens():
    """Long documents, default settings: the window a restore re-reads (tokens pulled since the
    restore point) stays within two buffers' worth of tokens plus the longest document twice, whatever
    ``buffer_size``. Before the token bound it was ``buffer_size`` documents (here ~35 times that bound),
    and before overdue documents came ahead of draining, a short remainder of a document waited
    while document after document longer than two rows drained (2.7 times the bound)."""
    rng = np.random.default_rng(1)
    seq_len, C = 63, 64
    # 30% of documents one to twenty rows long, the rest short: most tokens in long documents
    lengths = np.where(rng.random(6000) < 0.3, rng.integers(C, 20 * C, 6000), rng.integers(2, C, 6000))
    cum = np.concatenate([[0], np.cumsum(lengths)])
    packer = BestFitPack(FromList(make_docs(lengths)), seq_len=seq_len, buffer_size=1000)
    packer.reset(None)
    worst = 0
    for _ in range(3000):
        next(packer)
        state = packer.get_state()
        worst = max(worst, int(cum[state[BestFitPack.PULLED]] - cum[state[BestFitPack.BASE]]))
    bound = 2 * packer.buffer_tokens + 2 * int(lengths.max()) + BestFitPack.CHECKPOINT_ROWS * C
    assert worst <= bound, (worst, bound)
    assert packer.stats()["padding"] / (packer.stats()["rows"] * C) < 0.01


@pytest.mark.parametrize("core", ["c", "python"])
def test_crop_long_document_starts_the_next_row(core):
    """In crop mode a document of a row or more starts a row of its own, before overdue documents:
    it fills the row whatever else is buffered. Before, two overdue 3-token documents started the
    row and the long document was cropped to the 4 tokens left."""
    if core == "c" and pack_core.IMPLEMENTATION != "c":
        pytest.fail("the C core was not built; install with a C compiler (pip install -e .)")
    impl = pack_core._core if core == "c" else _packcore_py
    docs = make_docs([3, 3, 30, 3, 3, 3])
    packer = with_core(BestFitPack(FromList(docs), seq_len=9, buffer_size=3, max_wait=1, mode="crop"), impl)
    rows = run(packer)
    first = rows[0]
    assert first.seg_lens.tolist() == [10] and first.tokens.tolist() == docs[2].ids[:10].tolist()
    # the overdue documents start the next row, oldest first
    starts = [int(seg[0]) for seg in segments(rows[1])[0]]
    assert starts[:2] == [int(docs[0].ids[0]), int(docs[1].ids[0])]


def test_buffer_tokens_is_part_of_the_configuration(corpus, tok_path):
    from tokenloom.recipes import pretrain

    glob, _ = corpus
    build = lambda n: pretrain(glob, tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=50, buffer_tokens=n)
    loader = build(640)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ValueError, match="buffer_tokens"):
        build(1280).load_state_dict(state)
    with pytest.raises(ValueError, match="buffer_tokens"):
        build(0)

"""Long documents mixed in pieces (pipes/pieces.py) and appended back together by the best-fit packer."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tokenloom.pipes import BestFitPack, ReadParquet, ShardUnits, Tokenize, list_parquet_units, load_encoder, \
    resolve_files
from tokenloom.pipes.base import Node, StateError
from tokenloom.pipes.items import TokenDoc
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.pieces import Pieces

from tokenloom.pipes.pack import _packcore_py, core as pack_core

from .resume import check_node_resume
from .test_packing_ramp import with_core

T = 63
C = T + 1
B = 100_000  # b's first document number


class Docs(Node[TokenDoc]):
    """An endless in-memory source: its document k (lengths cycled) holds the token ids
    ``(first + k) * 10_000 + [0, n)``, so every token says which document it is of, and where."""

    AT = "at"
    STATE_KEYS = (AT,)

    def __init__(self, name: str, lengths: List[int], first: int):
        super().__init__()
        self.name, self.lengths, self.first = name, lengths, first
        self._at = 0

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._at = 0 if initial_state is None else int(initial_state[self.AT])

    def next(self) -> TokenDoc:
        k = self._at
        self._at += 1
        n = self.lengths[k % len(self.lengths)]
        ids = ((self.first + k) * 10_000 + np.arange(n)).astype(np.int32)
        return TokenDoc(ids, self.name, unit=0, pos=k)

    def get_state(self) -> Dict[str, Any]:
        return {self.AT: self._at}


def mixed(lengths_a, lengths_b, *, pieces: bool = True, weights=None, **packer):
    a, b = Docs("a", lengths_a, 0), Docs("b", lengths_b, B)
    feeds = {"a": Pieces(a, piece=C), "b": Pieces(b, piece=C)} if pieces else {"a": a, "b": b}
    mix = Mix(feeds, weights=weights or {"a": 0.5, "b": 0.5})
    return BestFitPack(mix, seq_len=T, buffer_size=packer.pop("buffer_size", 50), **packer)


def check_rows(rows) -> Dict[int, List[int]]:
    """Every segment is a run of one document's consecutive tokens and each document comes in
    order from its start, nothing repeated: returns each document's tokens as delivered."""
    got: Dict[int, List[int]] = {}
    for row in rows:
        at = 0
        for n in row.seg_lens.tolist():
            seg = row.tokens[at:at + n].astype(np.int64)
            doc = int(seg[0]) // 10_000
            assert (np.diff(seg) == 1).all() and int(seg[-1]) // 10_000 == doc, "a segment mixes documents"
            toks = got.setdefault(doc, [])
            assert int(seg[0]) % 10_000 == len(toks), f"document {doc} goes on at {seg[0] % 10_000}, not {len(toks)}"
            toks.extend(seg.tolist())
            at += n
    return got


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5 * C), min_size=1, max_size=12), st.lists(st.integers(1, 9 * C), min_size=1,
                                                                         max_size=12),
       st.sampled_from([1, 4, 50]))
def test_pieces_come_back_whole_and_cut_only_at_row_ends(la, lb, buffer_size):
    packer = mixed(la, lb, buffer_size=buffer_size)
    packer.reset()
    rows = [packer.next() for _ in range(60)]
    check_rows(rows)  # consecutive tokens, each document in order from its start
    # a segment followed by anything in its row ends its document
    for row in rows:
        at = 0
        for n in row.seg_lens.tolist()[:-1]:
            at += n
            last = int(row.tokens[at - 1])
            doc, pos = divmod(last, 10_000)
            src, k = (la, doc) if doc < B else (lb, doc - B)
            assert pos == src[k % len(src)] - 1, f"document {doc} cut at {pos + 1} inside a row"


@pytest.mark.parametrize("core", [pack_core._core, _packcore_py], ids=["c", "python"])
@pytest.mark.parametrize("buffer_size", [1, 2, 3, 1000])
def test_every_row_has_data_while_documents_come_in_pieces(buffer_size, core):
    """Issue 34: a parked piece (a row or less of a document whose next pieces are still to come) cannot
    be placed. It counted toward the buffer's bounds, so with every source parked the packer pulled
    nothing and gave rows of nothing but padding for ever (buffer 1-2), and a first piece filling the
    ramp's first row of tokens made the first row padding (any buffer)."""
    for la, lb in [([3 * C + 5], [2 * C]), ([C + 1, 7], [4 * C]), ([5 * C], [C, 3, 2 * C + 1])]:
        packer = with_core(mixed(la, lb, buffer_size=buffer_size), core)
        packer.reset()
        rows = [packer.next() for _ in range(80)]
        for r, row in enumerate(rows):
            assert row.seg_lens.sum() > 0, f"row {r} is nothing but padding ({la=}, {lb=}, {buffer_size=})"
        check_rows(rows)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 5 * C), min_size=1, max_size=6), st.lists(st.integers(1, 5 * C), min_size=1,
                                                                        max_size=6),
       st.lists(st.integers(1, 5 * C), min_size=1, max_size=6), st.integers(1, 4))
def test_no_row_is_padding_alone_with_three_sources_in_pieces(la, lb, lc, buffer_size):
    feeds = {n: Pieces(Docs(n, ls, k * B), piece=C) for k, (n, ls) in enumerate(zip("abc", (la, lb, lc)))}
    packer = BestFitPack(Mix(feeds, weights={"a": 1, "b": 1, "c": 1}), seq_len=T, buffer_size=buffer_size)
    packer.reset()
    rows = [packer.next() for _ in range(40)]
    assert all(row.seg_lens.sum() > 0 for row in rows), [int(row.seg_lens.sum()) for row in rows]


def test_a_long_document_takes_turns_with_the_other_source():
    # b's documents alternate 100 rows and 40 tokens; a's are 30 tokens. 50/50 by tokens.
    def worst_from_row_60(packer, rows=300):
        packer.reset()
        b = total = worst = 0
        for r in range(1, rows + 1):
            row = packer.next()
            for src, n in zip(row.sources, row.seg_lens.tolist()):
                total += n
                b += n if src == "b" else 0
            if r >= 60:
                worst = max(worst, abs(b / total - 0.5))
        return worst

    # what is left is the best-fit buffer's lag (up to 16 rows of a's short documents), not the long document
    assert worst_from_row_60(mixed([30], [100 * C, 40])) < 0.15
    # the control: whole documents, each long one drains alone
    assert worst_from_row_60(mixed([30], [100 * C, 40], pieces=False)) > 0.45


def test_the_stream_ends_after_the_document_in_pieces():
    # b stops after its long document would be picked in part: Mix finishes it before ending
    a, b = Docs("a", [20], 0), Docs("b", [10 * C], B)
    mix = Mix({"a": Pieces(a, piece=C), "b": Pieces(b, piece=C)}, weights={"a": 0.5, "b": 0.5})
    mix.reset()
    docs = [mix.next() for _ in range(6)]
    assert any(d.more for d in docs)
    mix._ended = True  # what a stop rule does
    rest = []
    try:
        while True:
            rest.append(mix.next())
    except StopIteration:
        pass
    assert rest and not rest[-1].more and len(rest[-1].ids) == 10 * C


@pytest.fixture(scope="module")
def parts(corpus, tok_path):
    glob, _ = corpus
    return list_parquet_units(resolve_files(glob), "text"), load_encoder(tok_path)


def _branch(units, enc, shard, source):
    node = ShardUnits(units.rows, shard=shard, num_shards=4, seed=3, epochs=None)
    return Tokenize(ReadParquet(node, units, column="text", seed=3, source=source), enc, bos=0, batch_docs=8)


def test_pieces_node_resumes_at_every_step(parts):
    units, enc = parts
    assert check_node_resume(lambda: Pieces(_branch(units, enc, 1, "x"), piece=9), max_steps=200) == 200
    node = Pieces(_branch(units, enc, 1, "x"), piece=9)
    node.reset()
    assert sum(node.next().more for _ in range(200)) > 50  # most documents came in pieces


def test_pieces_over_a_parent_without_state_before_last_resume_at_every_step():
    # Docs has no state_before_last: Pieces takes its state before every document (the fallback)
    assert not hasattr(Docs("a", [1], 0), "state_before_last")
    assert check_node_resume(lambda: Pieces(Docs("a", [3 * C + 5, 10, 2 * C], 0), piece=C), max_steps=60) == 60


def test_bestfit_over_pieces_resumes_at_every_step(parts):
    units, enc = parts

    def build():
        mix = Mix({"x": Pieces(_branch(units, enc, 1, "x"), piece=C), "y": Pieces(_branch(units, enc, 2, "y"), piece=C)},
                  weights={"x": 0.7, "y": 0.3})
        return BestFitPack(mix, seq_len=T, buffer_size=20, max_wait=30)

    assert check_node_resume(build, max_steps=120) == 120


@pytest.mark.parametrize("buffer_size", [1, 2])
def test_a_buffer_smaller_than_the_sources_in_pieces_resumes_at_every_step(buffer_size):
    """The slots of documents in pieces come on top of ``buffer_size`` (issue 34): a restore rebuilds them."""
    assert check_node_resume(lambda: mixed([3 * C + 5, 9], [2 * C, 4 * C + 1], buffer_size=buffer_size),
                             max_steps=80) == 80


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 5 * C), min_size=1, max_size=6), st.lists(st.integers(1, 5 * C), min_size=1,
                                                                        max_size=6),
       st.lists(st.integers(1, 5 * C), min_size=1, max_size=6), st.integers(1, 6))
def test_the_parked_slots_are_kept_as_they_change(la, lb, lc, buffer_size):
    """`core.Slots` keeps its parked slots and their tokens as pieces arrive and rows place from them, rather
    than the packer scanning its open slots each row: after every row they are what the arrays say."""
    feeds = {n: Pieces(Docs(n, ls, k * B), piece=C) for k, (n, ls) in enumerate(zip("abc", (la, lb, lc)))}
    packer = BestFitPack(Mix(feeds, weights={"a": 1, "b": 1, "c": 1}), seq_len=T, buffer_size=buffer_size)
    packer.reset()
    for _ in range(40):
        packer.next()
        slots = packer._slots
        slots.used_array()  # staged slots into the arrays
        rest = slots.len.astype(np.int64) - slots.used
        want = {s: int(rest[s]) for s in np.flatnonzero((slots.opened != 0) & (rest <= C)).tolist()}
        assert slots.parked_rest == want
        assert slots.parked_tokens == sum(want.values())


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 5 * C), min_size=1, max_size=8), st.lists(st.integers(1, 9 * C), min_size=1,
                                                                        max_size=8),
       st.sampled_from([1, 4, 50]), st.sampled_from([3, 1000]))
def test_c_core_and_python_twin_agree_on_pieces(la, lb, buffer_size, max_wait):
    if pack_core.IMPLEMENTATION != "c":
        pytest.fail("the C core was not built; install with a C compiler (pip install -e .)")
    out = []
    for impl in (pack_core._core, _packcore_py):
        packer = with_core(mixed(la, lb, buffer_size=buffer_size, max_wait=max_wait), impl)
        packer.reset()
        out.append([(r.tokens.tolist(), r.seg_lens.tolist()) for r in (packer.next() for _ in range(40))])
    assert out[0] == out[1]


def test_pretrain_mixes_a_long_document_in_pieces(tmp_path, tok_path, monkeypatch):
    """The recipe wires Pieces for bestfit with several sources: b's one document of ~470 rows takes
    turns with a's short ones (whole, it drains alone and b's share climbs past 0.9)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import tokenloom.recipes.packed_graph as packed
    from tokenloom.recipes import pretrain

    words = " ".join(f"w{i % 997}" for i in range(12_000))
    pq.write_table(pa.table({"text": [f"note {i} on the short side." for i in range(3000)]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [words] + [f"another line {i}" for i in range(300)]}), tmp_path / "b.parquet")

    def worst_share_of_b():
        loader = pretrain({"a": str(tmp_path / "a.parquet"), "b": str(tmp_path / "b.parquet")}, tokenizer=tok_path,
                          seq_len=T, batch_size=2, weights={"a": 0.5, "b": 0.5}, num_workers=0)
        it, worst = iter(loader), 0.0
        for k in range(150):
            next(it)
            if k >= 20:
                worst = max(worst, abs(loader.stats()["sources"]["b"]["share"] - 0.5))
        return worst

    assert worst_share_of_b() < 0.15
    monkeypatch.setattr(packed, "Pieces", lambda parent, piece: parent)  # the control: whole documents
    assert worst_share_of_b() > 0.3


def test_packers_that_cannot_join_pieces_refuse_them():
    from tokenloom.pipes import FlatPack

    def feed():
        return Mix({"a": Pieces(Docs("a", [10 * C], 0), piece=C), "b": Pieces(Docs("b", [20], B), piece=C)})

    flat = FlatPack(feed(), seq_len=T)
    flat.reset()
    with pytest.raises(ValueError, match="FlatPack got a piece of a document from source 'a'"):
        for _ in range(5):
            flat.next()
    crop = BestFitPack(feed(), seq_len=T, mode="crop")
    crop.reset()
    with pytest.raises(ValueError, match=r"mode='crop'\) got a piece"):
        crop.next()


def test_a_document_in_pieces_is_finished_when_its_weight_goes_to_zero():
    """A packer's slot waits for the rest of a document handed out in part: a schedule that takes the
    source's weight to 0 must not leave it waiting for good."""
    from tokenloom.pipes.schedule import StepClock

    clock = StepClock()
    a, b = Docs("a", [20], 0), Docs("b", [10 * C], B)
    mix = Mix({"a": Pieces(a, piece=C), "b": Pieces(b, piece=C)}, clock=clock,
              weights=[(0, {"a": 0.5, "b": 0.5}), (1, {"a": 1.0, "b": 0.0})])
    mix.reset()
    first = []
    while not any(d.source == "b" for d in first):
        first.append(mix.next())
    assert first[-1].more  # b's document is in pieces
    clock.batches = 1  # step 1: b's weight is 0 from now on
    rest = [mix.next() for _ in range(20)]
    pieces = [d for d in rest if d.source == "b"]
    assert [d.source for d in rest] == ["b"] * 9 + ["a"] * 11  # its other nine pieces first, then a alone
    assert not pieces[-1].more and len(pieces[-1].ids) == 10 * C


@pytest.mark.parametrize("num_workers", [0, 1, 2, 3])
def test_pretrain_with_pieces_resumes_exactly(tmp_path, tok_path, num_workers):
    """Saves that fall while a document of b (~470 rows, b's only text) is in pieces (2-row batches), with 0-3 workers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenloom.recipes import pretrain

    from .resume import check_loader_resume

    words = " ".join(f"w{i % 997}" for i in range(12_000))
    pq.write_table(pa.table({"text": [f"note {i} on the short side." for i in range(3000)]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [words] * 4}), tmp_path / "b.parquet")  # a row per shard
    build = lambda: pretrain({"a": str(tmp_path / "a.parquet"), "b": str(tmp_path / "b.parquet")},  # noqa: E731
                             tokenizer=tok_path, seq_len=T, batch_size=2, weights={"a": 0.5, "b": 0.5},
                             num_workers=num_workers)
    check_loader_resume(build, steps=[7, 31], total=48)
    if num_workers == 0:  # the saves fall inside b's document: b has delivered part of it, not all
        n = len(load_encoder(tok_path).encode_batch([words])[0])
        loader = build()
        it = iter(loader)
        for k in range(1, 32):
            next(it)
            if k in (7, 31):
                assert 0 < loader.stats()["sources"]["b"]["tokens"] < n


def test_piece_rows_sets_the_pieces_size_and_is_checked_at_resume(tmp_path, tok_path):
    """``piece_rows``: b's long document in pieces of 8 rows takes turns less often with a's short ones
    (its share swings wider over the first batches than with pieces of a row, narrower than whole);
    a resume is exact (0 and 2 workers); a state loads only into the same piece_rows, which the refusal
    names; left at 1, the config is a state's before the setting existed."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenloom.recipes import pretrain

    from .resume import check_loader_resume

    words = " ".join(f"w{i % 997}" for i in range(12_000))
    pq.write_table(pa.table({"text": [f"note {i} on the short side." for i in range(3000)]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": [words] * 4}), tmp_path / "b.parquet")
    sources = {"a": str(tmp_path / "a.parquet"), "b": str(tmp_path / "b.parquet")}

    def build(piece_rows=1, num_workers=0):
        return pretrain(sources, tokenizer=tok_path, seq_len=T, batch_size=2, weights={"a": 0.5, "b": 0.5},
                        num_workers=num_workers, piece_rows=piece_rows)

    def swing(piece_rows):
        loader, worst = build(piece_rows), 0.0
        it = iter(loader)
        for k in range(120):
            next(it)
            if k >= 20:
                worst = max(worst, abs(loader.stats()["sources"]["b"]["share"] - 0.5))
        return worst

    one, eight = swing(1), swing(8)
    assert one < eight < 0.3, (one, eight)
    for workers in (0, 2):
        check_loader_resume(lambda: build(8, workers), steps=[5, 23], total=36)
    assert "piece_rows" not in build().config and build(8).config["piece_rows"] == 8
    state = build(8).state_dict()
    with pytest.raises(ValueError, match=r"piece_rows"):
        build(1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"piece_rows=0 must be >= 1"):
        build(0)


def test_checkpoints_stay_bounded_while_documents_stay_open_for_long():
    """A document in pieces of a source the mix seldom draws stays open for thousands of pulls (its next
    piece comes with its source's next turn), and the packer's base cannot move past its latest piece. The
    checkpoints in between are thinned to those a state can still start from: as many as the buffer holds,
    not one per row pulled, and every state is what it was with all of them kept."""
    weights = {"rare": 0.002, **{f"s{k}": 1 for k in range(4)}}

    def build(thin: bool):
        feeds = {"rare": Pieces(Docs("rare", [40 * C], 9 * B), piece=C),
                 **{f"s{k}": Pieces(Docs(f"s{k}", [3, C // 2, 2 * C + 7, 9], k * B), piece=C) for k in range(4)}}
        packer = BestFitPack(Mix(feeds, weights=weights), seq_len=T, buffer_size=8)
        if not thin:
            packer._thin_checkpoints = lambda: None
        packer.reset()
        return packer

    thinned, kept = build(True), build(False)
    most = {"thinned": 0, "kept": 0}
    for step in range(900):
        assert thinned.next().tokens.tolist() == kept.next().tokens.tolist()
        assert thinned.state_dict() == kept.state_dict(), step
        # the invariant itself: for every buffered document, the last checkpoint at or before the pull it is
        # re-read from (the base once the documents before it are gone) is kept
        for seq in thinned._slot_of:
            at = thinned._repull.get(seq, seq)
            assert max(c[0] for c in thinned._ckpts if c[0] <= at) == max(c[0] for c in kept._ckpts if c[0] <= at), \
                (step, seq)
        most = {"thinned": max(most["thinned"], len(thinned._ckpts)), "kept": max(most["kept"], len(kept._ckpts))}
    bound = 2 * (8 + len(weights)) + 64 + 1  # twice the buffer, with a document in pieces a source
    assert most["thinned"] <= bound < 3 * bound < most["kept"], most


def test_a_document_in_pieces_is_re_read_from_its_latest_piece():
    """A restore re-reads a document that came in pieces from its latest piece (which holds all of it up to
    there), not from its first: with many sources that first piece lies thousands of pulls back, and the
    replay window reached back to it (docs/performance.md, "Many sources"). The window stays within the
    buffer's reach, the documents begin before the base, and every step
    resumes exactly."""
    n = 12

    def build():
        feeds = {f"s{k}": Pieces(Docs(f"s{k}", [40 * C, 3, 2 * C + 7, 9], k * B), piece=C) for k in range(n)}
        return BestFitPack(Mix(feeds, weights={f"s{k}": 1 for k in range(n)}), seq_len=T, buffer_size=8)

    packer = build()
    packer.reset()
    widest = 0
    before_base = False
    for _ in range(400):
        packer.next()
        state = packer.state_dict()
        widest = max(widest, state[BestFitPack.PULLED] - state[BestFitPack.BASE])
        before_base |= min(state[BestFitPack.LIVE], default=0) < 0
        for first, at, _ in state[BestFitPack.REPULL]:
            assert first < at  # re-read from a later piece
    assert before_base
    assert widest < 3 * (8 + n) + BestFitPack.CHECKPOINT_EVERY, widest  # a first piece is ~40 * n pulls back
    assert check_node_resume(build, max_steps=400) == 400


def test_a_damaged_repull_entry_is_refused_with_what_it_names():
    feeds = {f"s{k}": Pieces(Docs(f"s{k}", [40 * C, 3], k * B), piece=C) for k in range(6)}

    def build():
        return BestFitPack(Mix(feeds, weights={f"s{k}": 1 for k in range(6)}), seq_len=T, buffer_size=4)

    packer = build()
    packer.reset()
    state = None
    for _ in range(200):
        packer.next()
        state = packer.state_dict()
        if state[BestFitPack.REPULL]:
            break
    assert state[BestFitPack.REPULL], "no document re-read from a later piece in 200 rows"
    first, at, tok = state[BestFitPack.REPULL][0]
    for bad in ([max(state[BestFitPack.LIVE]) + 1, at, tok],  # no such buffered document
                [first, state[BestFitPack.PULLED] - state[BestFitPack.BASE], tok]):  # a pull outside the window
        damaged = dict(state, **{BestFitPack.REPULL: [bad] + state[BestFitPack.REPULL][1:]})
        with pytest.raises(StateError, match=r"re-reads document .* the state is damaged"):
            build().reset(damaged)

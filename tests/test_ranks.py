"""Two ranks simulated in one process: disjoint, covering, and in step on a finite epoch."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tokenloom.pipes import load_encoder, plan_epoch
from tokenloom.pipes.loader.rank_sync import ThreadSync
from tokenloom.recipes import pretrain


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(1, 40), min_size=1, max_size=30), num_shards=st.integers(1, 12),
       epoch=st.integers(0, 3), shuffle=st.booleans())
def test_plan_is_disjoint_covering_balanced(rows, num_shards, epoch, shuffle):
    rows = np.asarray(rows)
    seen = {}
    per_shard = []
    for g in range(num_shards):
        count = 0
        for s in plan_epoch(rows, seed=1, epoch=epoch, shard=g, num_shards=num_shards, shuffle=shuffle):
            for r in range(s.lo, s.hi):
                assert (s.unit, r) not in seen, f"row {(s.unit, r)} in shards {seen[(s.unit, r)]} and {g}"
                seen[(s.unit, r)] = g
            count += s.hi - s.lo
        per_shard.append(count)
    assert len(seen) == rows.sum()
    assert max(per_shard) - min(per_shard) <= 1


def _run_rank(build, rank, out):
    out[rank] = list(build(rank))


@pytest.fixture(scope="module")
def fitting_corpus(tmp_path_factory):
    """Heavy-tailed lengths capped at 120 words, so every document fits a row of 256 tokens and
    is never cut: each segment that starts with BOS then carries its document's whole id."""
    from .conftest import synthetic_texts, write_corpus

    root = tmp_path_factory.mktemp("fitting")
    texts = [" ".join(t.split()[:120]) for t in synthetic_texts(1500)]
    write_corpus(str(root), texts)
    return str(root / "*.parquet"), texts


@pytest.mark.parametrize("num_workers", [0, 2])
def test_two_ranks_finite_epoch(fitting_corpus, tok_path, num_workers):
    glob, texts = fitting_corpus
    sync = ThreadSync(2)

    def build(rank):
        return pretrain(glob, tokenizer=tok_path, seq_len=255, batch_size=4, epochs=1, rank=rank, world_size=2,
                        num_workers=num_workers, rank_sync=sync, seed=11)

    out = {}
    threads = [threading.Thread(target=_run_rank, args=(build, r, out)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(out) == {0, 1}, "a rank did not finish"
    assert len(out[0]) == len(out[1]), "ranks must take the same number of steps"
    padding = [sum(int((b["labels"] != -100).sum()) == 0 for b in out[r]) for r in (0, 1)]
    assert sum(padding) > 0, "this corpus gives unequal raw counts; the shorter rank must have padded"

    enc = load_encoder(tok_path)
    ids_per_rank = []
    for rank in (0, 1):
        ids = []
        for b in out[rank]:
            for row, seg in zip(b["input_ids"], b["segment_ids"]):
                for s in seg.unique().tolist():
                    if s == 0:
                        continue
                    toks = row[seg == s]
                    if int(toks[0]) == 0:  # a document start (BOS); its id follows
                        m = re.match(r"d\d{5}", enc.decode(toks[1:6].tolist()))
                        assert m, enc.decode(toks[:8].tolist())
                        ids.append(m.group(0))
        ids_per_rank.append(ids)
    all_ids = ids_per_rank[0] + ids_per_rank[1]
    assert len(all_ids) == len(set(all_ids)), "a document was seen twice"
    assert not set(ids_per_rank[0]) & set(ids_per_rank[1]), "ranks share documents"
    assert set(all_ids) == {t.split()[0] for t in texts}, "documents missing"

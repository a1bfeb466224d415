"""Mixing: strategies and stop rules through the resume helper, token shares, schedules,
changing weights at a checkpoint, and bad weights."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tokenloom.pipes import ReadParquet, ShardUnits, Tokenize, list_parquet_units, load_encoder, resolve_files
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.stats import format_stats
from tokenloom.recipes import pretrain

from .conftest import WORDS, write_corpus
from .resume import check_loader_resume, check_node_resume, items_equal

SOURCES = {"a": 200, "b": 120, "c": 80}


def short_texts(n, tag, seed, max_words=30):
    """Documents shorter than a 256-token row, so every segment is a whole document."""
    rng = np.random.default_rng(seed)
    return [f"{tag}{i:05d} " + " ".join(rng.choice(WORDS, int(k))) for i, k in
            enumerate(rng.integers(1, max_words, n))]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    out = {}
    for seed, (tag, n) in enumerate(SOURCES.items()):
        write_corpus(str(root / tag), short_texts(n, tag, seed), files=2, row_group_size=32)
        out[tag] = str(root / tag)
    return out


@pytest.fixture(scope="module")
def listed(sources, tok_path):
    """The tokenizer and the units of each source, loaded once: the nodes built from them are fresh
    at every restore, as in a worker; reading footers and the tokenizer file each time only costs time."""
    return load_encoder(tok_path), {name: list_parquet_units(resolve_files(path), "text")
                                    for name, path in sources.items()}


def branches(listed, shard=0, num_shards=1, **sharder):
    enc, units_of = listed
    out = {}
    for name, units in units_of.items():
        node = ShardUnits(units.rows, shard=shard, num_shards=num_shards, seed=1, **sharder)
        out[name] = Tokenize(ReadParquet(node, units, source=name, seed=1), enc, bos=0)
    return out


CASES = [
    dict(strategy="interleave", weights={"a": 0.5, "b": 0.3, "c": 0.2}),
    dict(strategy="interleave", unit="documents", weights={"a": 1, "b": 1, "c": 2}),
    dict(strategy="random", weights={"a": 0.5, "b": 0.3, "c": 0.2}, seed=3),
    dict(strategy="random", unit="documents", weights={"a": 0.2, "b": 0.2, "c": 0.6}, seed=3),
    dict(strategy="round_robin"),
    dict(strategy="alternating", pattern=["a", "a", "c", "b"], burst=3),
    dict(strategy="sequential", stop="all_exhausted", cycle_exhausted=False),
    dict(strategy="sequential", stop="first_exhausted"),
    dict(strategy="interleave", stop="first_exhausted", weights={"a": 0.2, "b": 0.3, "c": 0.5}),
    dict(strategy="interleave", stop="all_exhausted", cycle_exhausted=True),
    dict(strategy="round_robin", stop="all_exhausted", cycle_exhausted=False),
    dict(strategy="alternating", pattern=["c", "a"], stop="all_exhausted", cycle_exhausted=True, burst=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items() if k != "weights"))
def test_every_strategy_and_stop_rule_resumes_at_every_step(listed, case):
    limit = 1500 if case.get("stop") else 300
    n = check_node_resume(lambda: Mix(branches(listed), **case), max_steps=limit, horizon=3)
    assert n > 50
    if case.get("stop") in ("first_exhausted", "all_exhausted"):
        assert n < limit, "a stop rule must end the stream"


def test_stop_rules_count_documents(listed):
    """all_exhausted without cycling: every document exactly once; first_exhausted: ends when
    the smallest source (c, 80 docs) is done under round robin."""
    mix = Mix(branches(listed), strategy="round_robin", stop="all_exhausted", cycle_exhausted=False)
    mix.reset(None)
    docs = list(mix)
    assert len(docs) == sum(SOURCES.values())
    mix = Mix(branches(listed), strategy="round_robin", stop="first_exhausted")
    mix.reset(None)
    stats = (list(mix), mix.source_stats())[1]
    # a comes before c in every round: it has one more when c turns out to be exhausted
    assert stats["c"]["documents"] == 80 and stats["a"]["documents"] == 81


def _delivered(mix):
    """How many times each document (source, unit, row, epoch) comes out of the mixer, to its end."""
    mix.reset(None)
    seen = {}
    for doc in mix:
        key = (doc.source, doc.unit, doc.pos, doc.epoch)
        seen[key] = seen.get(key, 0) + 1
    return seen


@pytest.mark.parametrize("case", [dict(weights={"a": 2, "b": 1, "c": 1}), dict(strategy="round_robin"),
                                  dict(strategy="random", seed=3), dict(strategy="sequential")],
                         ids=lambda c: c.get("strategy", "interleave"))
def test_a_mix_of_finite_branches_with_its_defaults_delivers_every_document_once(listed, case):
    """Issue 42: sharders of ``epochs=1`` under a ``Mix`` left to its defaults. A branch that ends drops out
    and the others go on to their own end (the mixer used to end the stream with the first branch to end,
    leaving the rest of the others unread), and the stream resumes exactly at every step."""
    seen = _delivered(Mix(branches(listed, epochs=1), **case))
    assert len(seen) == sum(SOURCES.values()) and set(seen.values()) == {1}
    assert check_node_resume(lambda: Mix(branches(listed, epochs=1), **case), max_steps=1000, horizon=3) \
        == sum(SOURCES.values())


def test_a_mix_learns_first_epoch_and_passes_from_its_sharders(listed):
    """Round 2 of a two-epoch run (the sharders' first_epoch=4, epochs=2) under stop="all_exhausted" with the
    mixer told neither: it counts each source's passes from 4 and exhausts it after 2, so every document
    comes twice (told passes=1, first_epoch=0, it used to find every source exhausted at its first document)."""
    mix = Mix(branches(listed, epochs=2, first_epoch=4), stop="all_exhausted")
    seen = _delivered(mix)
    assert len(seen) == 2 * sum(SOURCES.values()) and set(seen.values()) == {1}
    assert {epoch for *_, epoch in seen} == {4, 5}
    assert {n: s["epochs"] for n, s in mix.source_stats().items()} == dict.fromkeys(SOURCES, 1)
    assert mix.cycle_exhausted is False, "a finite branch cannot cycle"


def test_cycling_a_finite_branch_is_refused_naming_the_source(listed):
    with pytest.raises(ValueError, match=r"source 'a' reads a sharder with epochs=1, so its branch ends .* "
                                         r"cycle_exhausted=True under stop='all_exhausted'; pass cycle_exhausted=False"):
        Mix(branches(listed, epochs=1), stop="all_exhausted", cycle_exhausted=True)


def _identify(batches, enc):
    """Independent count: tokens per source from the batches themselves (every segment is a whole
    document here, whose text starts with its source's tag)."""
    counts = {}
    for b in batches:
        for ids, seg, lab in zip(b["input_ids"], b["segment_ids"], b["labels"]):
            last = int(seg.max())
            for s in range(1, last + 1):
                toks = ids[seg == s]
                n = len(toks) + (1 if s == last and int(lab[-1]) != -100 else 0)
                tag = re.match(r"([abc])\d{5}", enc.decode(toks[1:5].tolist())).group(1)
                counts[tag] = counts.get(tag, 0) + n
    return counts


def test_token_shares_with_two_workers(sources, tok_path):
    weights = {"a": 0.5, "b": 0.3, "c": 0.2}
    loader = pretrain(sources, tokenizer=tok_path, weights=weights, seq_len=255, batch_size=4, num_workers=2,
                      buffer_size=64, seed=2)
    loader.dataset.factory.specials = {**loader.dataset.factory.specials, "end_label": None}  # raw labels (row[1:]): _identify reads row[T] from labels[:, -1]
    it = iter(loader)
    batches = [next(it) for _ in range(300)]
    stats = loader.stats()
    for name, w in weights.items():
        assert abs(stats["sources"][name]["share"] - w) < 0.02, format_stats(stats)
        assert stats["sources"][name]["target"] == pytest.approx(w)
    counted = _identify(batches, load_encoder(tok_path))
    assert counted == {n: s["tokens"] for n, s in stats["sources"].items()}, (counted, stats)
    assert stats["sources"]["c"]["epochs"] >= 1  # the small source cycled to keep its share
    # a pass over a source is every worker's pass over its own shard: the least, not the sum
    keys = list(loader.stats_keys)
    per_worker = [vec[keys.index("source/c/epochs")] for vec in loader.worker_stats().values()]
    assert len(per_worker) == 2 and stats["sources"]["c"]["epochs"] == min(per_worker)
    table = format_stats(stats)
    assert "a " in table and "share" in table


def test_schedule_switch_and_resume_between_switch_and_effect(sources, tok_path):
    k = 40
    schedule = [(0, {"a": 0.8, "b": 0.1, "c": 0.1}), (k, {"a": 0.1, "b": 0.1, "c": 0.8})]
    build = lambda: pretrain(sources, tokenizer=tok_path, weights=schedule, seq_len=255, batch_size=4,
                             buffer_size=32, seed=4)
    ref = check_loader_resume(build, steps=[k - 1, k + 1, k + 3], total=k + 40)
    enc = load_encoder(tok_path)
    before = _identify(ref[10:k], enc)
    after = _identify(ref[k + 15:], enc)  # past the buffer's delay
    share = lambda c, n: c.get(n, 0) / sum(c.values())
    assert abs(share(before, "a") - 0.8) < 0.05, before
    assert abs(share(after, "c") - 0.8) < 0.05, after


def test_change_weights_at_a_checkpoint(sources, tok_path):
    """Save; rebuild with other weights; load with allow_weight_change; nothing lost or repeated."""
    common = dict(tokenizer=tok_path, seq_len=255, batch_size=2, buffer_size=16, epochs=1, stop="all_exhausted",
                  cycle_exhausted=False, seed=6)
    loader = pretrain(sources, weights={"a": 0.8, "b": 0.1, "c": 0.1}, **common)
    it = iter(loader)
    head = [next(it) for _ in range(10)]
    state = loader.state_dict()
    other = pretrain(sources, weights={"a": 0.1, "b": 0.1, "c": 0.8}, **common)
    with pytest.raises(ValueError, match="weights"):
        other.load_state_dict(state)
    other.load_state_dict(state, allow_weight_change=True)
    tail = list(other)
    enc = load_encoder(tok_path)
    seen = []
    for b in head + tail:
        for ids, seg in zip(b["input_ids"], b["segment_ids"]):
            for s in range(1, int(seg.max()) + 1):
                seen.append(re.match(r"[abc]\d{5}", enc.decode(ids[seg == s][1:5].tolist())).group(0))
    assert len(seen) == len(set(seen)), "a document was repeated"
    assert len(seen) == sum(SOURCES.values()), "a document was lost"
    early = _identify(tail[:10], enc)
    assert early.get("c", 0) > early.get("a", 0), "the new weights took effect"


@pytest.mark.parametrize("weights,match", [
    ({"a": 1, "b": 1, "zz": 1}, r"unknown sources \['zz'\]"),
    ({"a": 1, "b": 1}, r"miss sources \['c'\]"),
    ({"a": 1, "b": -1, "c": 1}, r"weight for 'b' is -1"),
    ({"a": 1, "b": float("nan"), "c": 1}, r"weight for 'b' is nan"),
    ({"a": 0, "b": 0, "c": 0}, "all weights are zero"),
    ([(5, {"a": 1, "b": 1, "c": 1})], "must start at step 0"),
    ([(0, {"a": 1, "b": 1, "c": 1}), (0, {"a": 1, "b": 1, "c": 1})], "steps must increase"),
])
def test_bad_weights(sources, tok_path, weights, match):
    with pytest.raises(ValueError, match=match):
        pretrain(sources, tokenizer=tok_path, weights=weights)


def test_empty_source_is_named(sources, tok_path, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match="source 'empty' has 0 rows"):
        pretrain({**sources, "empty": str(tmp_path / "empty.parquet")}, tokenizer=tok_path)

"""A graph composed by hand continues on another topology like a recipe's (issue 35).

The README's pattern (tests/composed.py): tokenloom's nodes, a user's filter node (declared
``ROLE = PASS``), a ``torchdata.nodes.Mapper``, two sources mixed and packed best-fit, run by
``TokenLoomLoader``. Saved at several steps on 2 workers (and on 2 ranks x 2 workers), resumed on
1 and 3 workers from the list of states: the token-level oracle sees every token of every document
the filter keeps delivered once. On the same topology the resume is bitwise. A graph with a node
that may hold documents between calls is refused before the first batch, naming it.
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.pipes import Node

from .composed import Composed, loader_builder
from .oracle import BOS, Hop, Oracle, make_corpus, run_chain
from .test_custom_node import LengthFilter

T, B, MIN_TOKENS = 32, 2, 6


class Holding(LengthFilter):
    """The same filter, declaring no role: for all the loader knows, it holds documents between calls."""

    ROLE = Node.ROLE


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("composed")), {"a": ("parquet", 70), "b": ("jsonl", 50)},
                       row=T + 1, seed=35)


def _builder(corpus, filter_cls=LengthFilter, mix_defaults=False):
    return loader_builder(Composed({"a": ("parquet", corpus.sources["a"]), "b": ("jsonl", corpus.sources["b"])},
                                   corpus.tokenizer, T, B, weights={"a": 2, "b": 1}, min_tokens=MIN_TOKENS,
                                   filter_cls=filter_cls, mix_defaults=mix_defaults))


def _oracle(corpus):
    seqs, _ = corpus.sequences(False)
    dropped = frozenset(d for d, s in enumerate(corpus.doc_source) if s == "a" and len(seqs[d]) < MIN_TOKENS)
    assert dropped, "the filter drops nothing here: it would not be tested"
    return Oracle(corpus, epochs=1, mode="bestfit", end_label=BOS, dropped=dropped)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("steps", [1, 5, 12])
def test_a_composed_graph_resumes_on_other_workers_every_kept_token_once(corpus, world, steps):
    build = _builder(corpus)
    for new_workers in (1, 3):
        oracle = _oracle(corpus)
        run_chain(build, [Hop(world, 2, steps), Hop(world, new_workers, None)], oracle, limit=120)
        oracle.finish()


@pytest.mark.parametrize("hops", [[Hop(1, 2, None)], [Hop(1, 2, 7), Hop(1, 1, None)], [Hop(1, 2, 7), Hop(1, 3, None)],
                                  [Hop(2, 1, 3), Hop(1, 2, None)]], ids=lambda h: "-".join(map(str, h)))
def test_finite_sharders_under_a_default_mix_deliver_every_kept_token_once(corpus, hops):
    """Issue 42: the README's two-source composition, each sharder ``epochs=1`` and ``Mix(branches,
    weights=...)`` with its defaults. The mixer used to end a worker's stream with the first branch to
    end, so the run lost the rest of the other source, and an elastic resume (which hands every unread
    row over) lost and repeated other documents than the uninterrupted run."""
    oracle = _oracle(corpus)
    run_chain(_builder(corpus, mix_defaults=True), hops, oracle, limit=120)
    oracle.finish()


@pytest.mark.parametrize("mix_defaults", [False, True])
def test_a_composed_graph_resumes_bitwise_on_the_same_topology(corpus, mix_defaults):
    from .resume import check_loader_resume

    build = _builder(corpus, mix_defaults=mix_defaults)
    assert len(check_loader_resume(lambda: build(0, 1, 2), steps=[2, 9], total=None)) > 20


def test_a_node_that_may_hold_documents_is_refused_naming_it(corpus):
    build = _builder(corpus, Holding)
    old = build(0, 1, 2)
    it = iter(old)
    next(it)
    state = old.state_dict()
    del it
    new = build(0, 1, 1)
    with pytest.raises(ValueError, match=r"Holding cannot continue on another topology .* declare ROLE = PASS"):
        new.load_state_dict([state])
    assert torch.equal(next(iter(build(0, 1, 1)))["input_ids"], next(iter(new))["input_ids"]), \
        "the refused load changed the loader"

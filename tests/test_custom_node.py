"""A user's own node, composed into the pipeline by hand and run by the same bridge.

This file doubles as the README's "compose your own node" example: a node fills
`reset`, `next` and `get_state` and declares its `STATE_KEYS`; its parent's state
sits under one key; the factory builds the graph for one shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from tokenloom.pipes import (Batch, BestFitPack, Node, ReadParquet, ShardContext, ShardUnits, Tokenize,
                             TokenLoomLoader, list_parquet_units, load_encoder, resolve_files)
from tokenloom.pipes.roles import PASS

from tokenloom.testing import check_loader_resume, check_node_resume  # the public helper, as users call it


class LengthFilter(Node):
    """Drops tokenized documents shorter than ``min_tokens``, and counts them. It maps one document at a
    time and holds none between calls, and says so (``ROLE = PASS``): a graph holding it can continue
    on another topology, where it starts afresh (test_composed_elastic.py)."""

    ROLE = PASS
    PARENT = "parent"
    DROPPED = "dropped"
    STATE_KEYS = (PARENT, DROPPED)

    def __init__(self, parent, min_tokens: int):
        super().__init__(parent)  # its parents: the graph's edges (pipes/graph.py)
        self.parent, self.min_tokens = parent, min_tokens
        self.dropped = 0

    def reset(self, initial_state=None):
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])
        self.dropped = 0 if initial_state is None else initial_state[self.DROPPED]

    def next(self):
        while True:
            doc = next(self.parent)
            if len(doc.ids) >= self.min_tokens:
                return doc
            self.dropped += 1

    def get_state(self):
        return {self.PARENT: self.parent.state_dict(), self.DROPPED: self.dropped}


@dataclass
class FilteredGraph:
    glob: str
    tokenizer: str
    min_tokens: int = 20

    def __call__(self, ctx: ShardContext):
        units = list_parquet_units(resolve_files(self.glob), "text")
        node = ShardUnits(units.rows, shard=ctx.shard, num_shards=ctx.num_shards, seed=1, epochs=1,
                          first_epoch=ctx.round)
        node = ReadParquet(node, units, seed=1)
        node = Tokenize(node, load_encoder(self.tokenizer), bos=0)
        node = LengthFilter(node, self.min_tokens)
        node = BestFitPack(node, seq_len=127, buffer_size=30)
        return Batch(node, batch_size=2, seq_len=127)


def test_custom_node_every_step(corpus, tok_path):
    glob, _ = corpus
    graph = FilteredGraph(glob, tok_path)
    n = check_node_resume(lambda: graph(ShardContext(0, 1, 0, 0)).parent.parent, max_steps=400)
    assert n > 100


def test_a_misbehaving_node_is_told_what_to_fix():
    class Forgetful(Node):
        STATE_KEYS = ("a", "b")

        def reset(self, initial_state=None):
            pass

        def next(self):
            return 1

        def get_state(self):
            return {"a": 1}

    node = Forgetful()
    with pytest.raises(ValueError, match=r"returned keys \['a'\] but declares STATE_KEYS=\['a', 'b'\]"):
        node.state_dict()
    with pytest.raises(ValueError, match=r"missing=\['b'\]"):
        node.reset({"a": 1})


def test_only_keys_added_later_may_be_missing_from_a_saved_state():
    class Grown(Node):
        STATE_KEYS = ("a", "b", "c")
        KEYS_ADDED = ("c",)  # a state saved before "c" existed restores without it

        def reset(self, initial_state=None):
            self.got = initial_state

        def next(self):
            return 1

        def get_state(self):
            return {"a": 1, "b": 2, "c": 3}

    node = Grown()
    node.reset({"a": 1, "b": 2})
    assert node.got == {"a": 1, "b": 2}
    with pytest.raises(ValueError, match=r"missing=\['b'\]"):
        node.reset({"a": 1, "c": 3})
    with pytest.raises(ValueError, match=r"extra=\['d'\]"):
        node.reset({"a": 1, "b": 2, "c": 3, "d": 4})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_graph_through_the_loader(corpus, tok_path, num_workers):
    glob, _ = corpus

    def build():
        return TokenLoomLoader(FilteredGraph(glob, tok_path), config={"min_tokens": 20}, num_workers=num_workers)

    ref = check_loader_resume(build, steps=[3, 10], total=None)
    assert len(ref) > 20
    # every whole document in a row (a segment that starts with BOS and is not the row's
    # last segment, which the input view may cut) is at least min_tokens long
    checked = 0
    for b in ref:
        for ids, seg in zip(b["input_ids"], b["segment_ids"]):
            last = int(seg.max())
            for s in range(1, last):
                toks = ids[seg == s]
                if int(toks[0]) == 0:
                    assert len(toks) >= 20, f"a {len(toks)}-token document passed the filter"
                    checked += 1
    assert checked > 20


def test_a_composed_graph_resumed_with_other_workers_is_refused_naming_them(corpus, tok_path):
    """Issue 34: a composed graph's state loaded into a loader with another ``num_workers`` failed with a
    bare AssertionError inside torchdata; it is refused as pretrain refuses it, naming the setting."""
    glob, _ = corpus
    saver = TokenLoomLoader(FilteredGraph(glob, tok_path), config={"min_tokens": 20}, num_workers=2)
    it = iter(saver)
    for _ in range(3):
        next(it)
    state = saver.state_dict()
    del it
    for workers in (0, 1, 3):
        other = TokenLoomLoader(FilteredGraph(glob, tok_path), config={"min_tokens": 20}, num_workers=workers)
        with pytest.raises(ValueError, match=rf"num_workers: saved with 2, this loader has {workers}"):
            other.load_state_dict(state)


def test_a_composed_graph_is_walked_through_its_declared_parents(corpus, tok_path):
    """Issue 35: the graph's shape is declared (parents, roles), so a user's node and a torchdata node
    in the middle hide nothing from the walkers: the packer's save point finds the reader, its
    sharder and its branch through them, as in a recipe's graph."""
    from torchdata.nodes import Mapper

    from tokenloom.pipes.graph import BATCH, BRANCH, PACKER, PASS, READER, SHARD, role_of, walk

    glob, _ = corpus
    units = list_parquet_units(resolve_files(glob), "text")
    sharder = ShardUnits(units.rows, shard=0, num_shards=1, seed=1, epochs=1)
    reader = ReadParquet(sharder, units, seed=1)
    branch = Tokenize(reader, load_encoder(tok_path), bos=0)
    mapped = Mapper(LengthFilter(branch, 20), lambda doc: doc)
    packer = BestFitPack(mapped, seq_len=127, buffer_size=30)
    root = Batch(packer, batch_size=2, seq_len=127)
    assert [role_of(n) for n in walk(root)] == [BATCH, PACKER, PASS, PASS, BRANCH, READER, SHARD]
    root.reset()
    next(root)
    point = root.state_dict()[Batch.PARENT][BestFitPack.ELASTIC]
    assert list(point["sources"]) == [reader.source], "the save point did not find the reader past the user's nodes"


def test_a_node_that_nests_its_parent_but_declares_none_is_told_how():
    class Undeclared(Node):
        PARENT = "parent"
        STATE_KEYS = (PARENT,)

        def __init__(self, parent):
            super().__init__()
            self.parent = parent

    with pytest.raises(TypeError, match=r"declared no parent: pass it to the base class, super\(\).__init__\(parent\)"):
        Undeclared(ShardUnits(np.ones(3, np.int64), shard=0, num_shards=1, seed=0))


class ForgetfulSampler(LengthFilter):
    """Keeps every other document and counts them, but its state forgets the counter: the mistake a
    node author makes, which the public helper must catch."""

    SEEN = "seen"
    STATE_KEYS = (LengthFilter.PARENT,)

    def reset(self, initial_state=None):
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])
        self.seen = 0  # not restored: the bug

    def next(self):
        while True:
            doc = next(self.parent)
            self.seen += 1
            if self.seen % 2:
                return doc

    def get_state(self):
        return {self.PARENT: self.parent.state_dict()}


def test_the_public_helper_names_the_step_a_forgetful_node_goes_wrong(corpus, tok_path):
    glob, _ = corpus

    def build():
        units = list_parquet_units(resolve_files(glob), "text")
        node = ReadParquet(ShardUnits(units.rows, shard=0, num_shards=1, seed=1, epochs=1), units, seed=1)
        return ForgetfulSampler(Tokenize(node, load_encoder(tok_path), bos=0), 0)
    with pytest.raises(AssertionError, match=r"restored at step 1: item 1 differs from the uninterrupted run"):
        check_node_resume(build, max_steps=50)

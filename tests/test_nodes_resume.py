"""Every node of the pretrain graph, saved at every step and restored into a fresh node."""

from __future__ import annotations

import pytest

from tokenloom.pipes import (Batch, BestFitPack, FlatPack, ReadParquet, ShardUnits, Tokenize, list_parquet_units,
                             load_encoder, resolve_files)
from tokenloom.pipes.pack.stats import PACK_STAT_KEYS
from tokenloom.pipes.stats import WithStats

from .resume import check_node_resume


@pytest.fixture(scope="module")
def parts(corpus, tok_path):
    glob, _ = corpus
    units = list_parquet_units(resolve_files(glob), "text")
    enc = load_encoder(tok_path)
    return units, enc


def _reader(units, shard=1, num_shards=2, epochs=2):
    node = ShardUnits(units.rows, shard=shard, num_shards=num_shards, seed=3, epochs=epochs)
    return ReadParquet(node, units, column="text", seed=3)


def test_shard_units(parts):
    units, _ = parts
    n = check_node_resume(lambda: ShardUnits(units.rows, shard=1, num_shards=3, seed=5, epochs=3))
    assert n > 5


def test_read_parquet(parts):
    units, _ = parts
    assert check_node_resume(lambda: _reader(units), max_steps=200) == 200


def test_read_parquet_finite_to_the_end(parts):
    units, _ = parts
    n = check_node_resume(lambda: _reader(units, shard=3, num_shards=4, epochs=1), max_steps=1000, horizon=2)
    assert 300 < n < 1000  # one epoch of a quarter of 1500 rows, and it ended


def test_tokenize(parts):
    units, enc = parts
    n = check_node_resume(lambda: Tokenize(_reader(units), enc, bos=0, eos=1, batch_docs=7), max_steps=150)
    assert n == 150


@pytest.mark.parametrize("packer", ["flat", "bestfit", "crop"])
def test_packers(parts, packer):
    units, enc = parts

    def build():
        # a quarter of the corpus: every step is restored, and each restore re-tokenizes its window
        tok = Tokenize(_reader(units, shard=1, num_shards=4, epochs=1), enc, bos=0, batch_docs=16)
        if packer == "flat":
            return FlatPack(tok, seq_len=63, pad_id=2)
        return BestFitPack(tok, seq_len=63, buffer_size=40, pad_id=2, max_wait=60, mode=packer)

    n = check_node_resume(build, max_steps=2000, horizon=3)
    assert 100 < n < 2000  # ran to the end of the finite stream, including the buffer flush


def test_bestfit_state_independent_of_buffer_contents(parts):
    """The state holds positions, not tokens: a few KB even with a large buffer."""
    import pickle

    units, enc = parts
    node = BestFitPack(Tokenize(_reader(units, epochs=None), enc, bos=0), seq_len=63, buffer_size=500)
    node.reset(None)
    for _ in range(50):
        next(node)
    size = len(pickle.dumps(node.state_dict()))
    assert size < 8_000, size


def test_batch_and_stats(parts):
    units, enc = parts

    def build():
        tok = Tokenize(_reader(units, shard=1, num_shards=4, epochs=1), enc, bos=0, batch_docs=16)
        packer = BestFitPack(tok, seq_len=31, buffer_size=20, pad_id=2)
        return WithStats(Batch(packer, batch_size=3, seq_len=31, pad_id=2),
                         counters=lambda: [packer.stats()[k] for k in PACK_STAT_KEYS], keys=PACK_STAT_KEYS, worker=0)

    n = check_node_resume(build, max_steps=1000, horizon=2)
    assert n > 50

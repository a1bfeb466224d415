"""Many sources at the cost of one (issue 46): a worker's state crosses as a patch of the one before
(pipes/state_delta.py), and the nodes that keep something per source retake only what moved."""

from __future__ import annotations

import pickle
import random

import pytest

from tokenloom.pipes import ReadParquet, ShardUnits, Tokenize, list_parquet_units, load_encoder, resolve_files
from tokenloom.pipes.mix import Mix
from tokenloom.pipes.pieces import Pieces
from tokenloom.pipes import state_delta
from tokenloom.pipes.state_delta import diff, patch
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus


def _random_state(rng: random.Random, depth: int = 0):
    kind = rng.random()
    if depth > 3 or kind < 0.3:
        return rng.choice([0, 1, -5, 2.5, "x", None, True, 10 ** 12])
    if kind < 0.65:
        return {f"k{i}": _random_state(rng, depth + 1) for i in range(rng.randint(0, 6))}
    return [_random_state(rng, depth + 1) for _ in range(rng.choice([0, 2, 5, 20, 40]))]


def _mutate(rng: random.Random, value):
    """A copy of ``value`` with some leaves, lists or keys changed; untouched parts are the same objects."""
    if isinstance(value, dict):
        if value and rng.random() < 0.1:
            return {k: v for k, v in list(value.items())[1:]}  # a key gone
        return {k: (_mutate(rng, v) if rng.random() < 0.3 else v) for k, v in value.items()}
    if isinstance(value, list):
        if rng.random() < 0.1:
            return value + [1]
        return [(_mutate(rng, v) if rng.random() < 0.2 else v) for v in value]
    return rng.choice([value, 7, "y", 3.5, None])


def test_a_patch_rebuilds_every_state_and_keeps_what_did_not_change():
    rng = random.Random(46)
    for _ in range(400):
        old = _random_state(rng)
        new = _mutate(rng, old)
        change = pickle.loads(pickle.dumps(diff(old, new)))  # as it crosses the queue
        got = patch(old, change)
        assert got == new and type(got) is type(new)
        if isinstance(new, dict) and isinstance(old, dict) and list(new) == list(old):
            for k in new:
                if new[k] is old[k]:
                    assert got[k] is old[k]  # shared, not copied


def test_a_patch_out_of_turn_is_refused():
    state_delta.forget_streams()
    assert state_delta.receive("s", 0, (state_delta.PUT, {"a": 1})) == {"a": 1}
    assert state_delta.receive("s", 1, diff({"a": 1}, {"a": 2})) == {"a": 2}
    with pytest.raises(RuntimeError, match="patch number 3 of stream s arrived after number 1"):
        state_delta.receive("s", 3, diff({"a": 2}, {"a": 3}))
    with pytest.raises(RuntimeError, match="arrived after none"):
        state_delta.receive("other", 5, (state_delta.SAME,))
    state_delta.forget_streams()


@pytest.fixture(scope="module")
def many(tmp_path_factory, tok_path):
    root = tmp_path_factory.mktemp("many")
    paths = {}
    for i in range(24):
        texts = synthetic_texts(3 + i % 5, seed=i, tag=f"s{i}-")
        if i % 4 == 0:
            texts = [t * 40 for t in texts]  # long documents: pieces, parked slots
        write_corpus(str(root / f"s{i:02d}"), texts, files=1, row_group_size=4)
        paths[f"s{i:02d}"] = str(root / f"s{i:02d}")
    return paths


def test_the_mixers_cached_branch_states_are_the_branches_states_at_every_step(many, tok_path):
    enc = load_encoder(tok_path)
    feeds = {}
    for name, path in many.items():
        units = list_parquet_units(resolve_files(path), "text")
        node = ShardUnits(units.rows, shard=0, num_shards=1, seed=1)
        feeds[name] = Pieces(Tokenize(ReadParquet(node, units, source=name, seed=1), enc, bos=0, batch_docs=3),
                             piece=40)
    mix = Mix(feeds, weights={n: 1 + i % 3 for i, n in enumerate(feeds)})
    mix.reset(None)
    for step in range(300):
        state = mix.state_dict()
        assert state[Mix.CHILDREN] == {n: c.state_dict() for n, c in zip(mix.names, mix.children)}, step
        assert list(state[Mix.CHILDREN]) == mix.names
        next(mix)
        if step == 150:  # a restore forgets what was cached
            mix.reset(state)


def _docs_of(state):
    """The save point's documents in flight (pack/savepoint.py) in a worker's graph state."""
    node = state["node"]
    while "elastic" not in node:
        node = node["parent"]
    return node["elastic"]["docs"]


def _step_bytes(sources, tok_path, steps=40):
    """Mean bytes a step's state takes as pickled: whole, as a patch of the step before, and the part of
    that patch that is the save point's documents in flight."""
    loader = pretrain(sources, tokenizer=tok_path, seq_len=63, batch_size=1, buffer_size=8, seed=3,
                      weights={n: 1.0 for n in sources})
    it = iter(loader)
    next(it)
    prev = loader.dataset.state_dict()
    whole = parts = docs = 0
    for _ in range(steps):
        next(it)
        state = loader.dataset.state_dict()
        change = diff(prev, state)
        assert patch(prev, pickle.loads(pickle.dumps(change))) == state
        whole += len(pickle.dumps(state))
        parts += len(pickle.dumps(change))
        docs += len(pickle.dumps(_docs_of(state))) if _docs_of(state) != _docs_of(prev) else 0
        prev = state
    return whole / steps, parts / steps, docs / steps


def test_a_steps_patch_grows_with_what_moved_not_with_the_sources(many, tok_path):
    """Three times the sources: the whole state per step grows about as much; the patch (what a worker
    sends) grows only by the documents in flight, which name each source's tokenizer batch (a few
    bytes a source, compressed, pack/savepoint.py). (Speed is benchmarks/sources.py's.)"""
    few = {n: many[n] for n in list(many)[:8]}
    whole_few, patch_few, docs_few = _step_bytes(few, tok_path)
    whole_many, patch_many, docs_many = _step_bytes(many, tok_path)
    assert whole_many > 2 * whole_few, (whole_few, whole_many)
    assert patch_many - docs_many < 1.3 * (patch_few - docs_few), (patch_few, docs_few, patch_many, docs_many)
    assert docs_many / len(many) < 80, docs_many
    assert patch_many < 0.5 * whole_many


def test_workers_send_their_states_as_patches_and_a_resume_is_exact(many, tok_path):
    """Through real worker processes: each worker's states arrive as one numbered stream of patches
    (the first whole), and the state rebuilt from them resumes with the exact next batches."""
    kw = dict(tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=8, seed=5, weights={n: 1.0 for n in many},
              num_workers=2)
    state_delta.forget_streams()
    loader = pretrain(many, **kw)
    it = iter(loader)
    for _ in range(12):
        next(it)
    saved = loader.state_dict()
    expected = [next(it)["input_ids"].tolist() for _ in range(6)]
    del it
    streams = state_delta.forget_streams()
    assert len(streams) == 2 and all(n >= 6 for n in streams.values()), streams
    again = pretrain(many, **kw)
    again.load_state_dict(saved)
    it = iter(again)
    assert [next(it)["input_ids"].tolist() for _ in range(6)] == expected


def test_a_batchs_counters_cross_as_their_changed_entries_and_out_of_turn_is_refused():
    """pipes/stats.py: what a worker's `Counters` pickle to (their `Sending` stream) rebuilds every vector in
    the training process; a patch names only the entries that changed; one out of turn is refused."""
    import numpy as np

    from tokenloom.pipes import stats

    rng = np.random.default_rng(46)
    sending = state_delta.Sending(stats._vector_patch)
    vector = np.zeros(6 * 1024 + 10, np.int64)
    for k in range(30):
        vector = vector.copy()
        changed = rng.choice(len(vector), size=int(rng.integers(0, 40)), replace=False)
        vector[changed] += rng.integers(1, 1000, len(changed))
        worker, sent = 1, sending.send(vector.copy())
        stream, number, (at, values) = sent
        assert number == k and (at is None) == (k == 0)
        if at is not None:
            assert sorted(at) == sorted(changed.tolist())
        got = pickle.loads(pickle.dumps(stats._received_counters(worker, *sent)))
        assert got.as_list() == vector.tolist() and got.worker == 1
    stream, number, change = sending.send(vector.copy())
    with pytest.raises(RuntimeError, match=f"patch number {number + 1} of stream {stream} came after number {number - 1}"):
        stats._received_counters(1, stream, number + 1, change)

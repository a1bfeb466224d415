"""Batches cross from a worker to the main process as numpy (pipes/loader/wire.py) and come back bitwise."""

from __future__ import annotations

import gc
import io
import pickle
import weakref
from collections import namedtuple
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

from tokenloom.pipes.loader.wire import STALE_KEY, STALE_MESSAGE, WireBatch, unwrap
from tokenloom.pipes.loader.wire_ring import BatchRing
from tokenloom.recipes import pretrain

from .resume import items_equal

Pair = namedtuple("Pair", "a b")


def _through_queue(obj):
    """What a DataLoader worker queue does to an object: ForkingPickler out, pickle in."""
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.DEFAULT_PROTOCOL).dump(obj)
    return pickle.loads(buf.getvalue())


def test_round_trip_is_bitwise_and_keeps_what_is_not_a_tensor():
    batch = {
        "input_ids": torch.arange(12, dtype=torch.int64).view(3, 4),
        "segment_ids": torch.tensor([[1, 1, 2, 0]], dtype=torch.int32),
        "max_seqlen": torch.tensor(7, dtype=torch.int32),
        "bf16": torch.ones(2, dtype=torch.bfloat16),  # numpy has no bfloat16: travels as a tensor
        "user_array": np.arange(3, dtype=np.int16),  # the user's own numpy stays numpy
        "names": ["code", "prose"],
        "nested": [(torch.zeros(2), "x")],
        "pair": Pair(1, 2),
    }
    wire = WireBatch(batch)
    assert isinstance(wire.payload["input_ids"], type(wire.payload["segment_ids"]))
    assert not isinstance(wire.payload["input_ids"], torch.Tensor)  # really numpy on the wire
    got = unwrap(_through_queue(wire))
    assert items_equal(got["input_ids"], batch["input_ids"])
    assert items_equal(got["segment_ids"], batch["segment_ids"])
    assert items_equal(got["max_seqlen"], batch["max_seqlen"])
    assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["bf16"], batch["bf16"])
    assert isinstance(got["user_array"], np.ndarray) and got["user_array"].dtype == np.int16
    assert got["names"] == ["code", "prose"] and type(got["pair"]) is Pair
    assert isinstance(got["nested"][0], tuple) and torch.equal(got["nested"][0][0], torch.zeros(2))
    got["input_ids"][0, 0] = 99  # writable, like a tensor the graph built
    assert got["input_ids"].dtype == torch.int64
    assert unwrap(batch) is batch  # a batch that never left the process is passed through


def test_int64_travels_as_int32_only_when_every_value_fits():
    big = torch.tensor([[0, 2**31 - 1], [-(2**31), 5]], dtype=torch.int64)
    huge = torch.tensor([2**31, -1], dtype=torch.int64)
    wire = WireBatch({"fits": big, "huge": huge, "empty": torch.empty(0, 3, dtype=torch.int64)})
    sent = {k: wire.payload[k].__reduce__()[1][0] for k in ("fits", "huge")}  # what the pipe carries
    assert sent["fits"].dtype == np.int32 and sent["huge"].dtype == np.int64
    got = unwrap(_through_queue(wire))
    for k, v in {"fits": big, "huge": huge}.items():
        assert got[k].dtype == torch.int64 and torch.equal(got[k], v)
    assert got["empty"].shape == (0, 3) and got["empty"].dtype == torch.int64


def test_the_loop_gets_the_same_tensors_with_and_without_workers(corpus, tok_path):
    def first(n_workers):
        loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=1,
                          num_workers=n_workers, epochs=1)
        return [b for b in loader]

    alone, workers = first(0), first(1)  # one worker sees the same single shard as no workers
    assert len(alone) == len(workers) > 3
    for a, b in zip(alone, workers):
        assert set(a) == set(b)
        assert all(isinstance(v, torch.Tensor) for v in b.values())
        assert all(items_equal(a[k], b[k]) for k in a)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs an accelerator")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_every_tensor_of_a_batch_is_pinned_with_pin_memory(corpus, tok_path, num_workers):
    """What users rely on with ``pin_memory=True``: each tensor of every batch the loop gets is in
    pinned memory, so the copy to the GPU can run asynchronously (issue 34: the test before this one
    called a method batches no longer have, and only a GPU machine ran it)."""
    from tokenloom.recipes import pretrain

    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=64, batch_size=4, num_workers=num_workers,
                      pin_memory=True)
    for _, batch in zip(range(4), loader):
        assert type(batch) is dict
        unpinned = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and not v.is_pinned()]
        assert not unpinned, f"not pinned: {unpinned}"


def _batch(seed: int, rows: int = 4, width: int = 64):
    g = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 50_000, (rows, width), generator=g),
            "labels": torch.randint(-100, 50_000, (rows, width), generator=g),
            "segment_ids": torch.randint(0, 5, (rows, width), generator=g, dtype=torch.int32),
            "big": torch.tensor([2**40, 1]), "max_seqlen": torch.tensor(width, dtype=torch.int32)}


def _same(a, b):
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_batches_through_the_ring_wrap_around_and_free_their_space():
    one = sum(WireBatch(_batch(0)).payload[k].array.nbytes for k in _batch(0))
    ring = BatchRing(3 * one)  # room for about two batches at a time: every third one wraps
    sent = [_batch(i) for i in range(20)]
    for i in range(0, 20, 2):  # two in flight, as a worker with two ready batches
        wires = [WireBatch(b, ring) for b in sent[i:i + 2]]
        assert all(w._freed_to is not None for w in wires)  # both went through the ring
        bytes_ = [ForkingPickler.dumps(w) for w in wires]
        assert all(len(b) < 2000 for b in bytes_)  # the queue carries where the arrays are, not them
        for b, want in zip(bytes_, sent[i:i + 2]):
            _same(unwrap(pickle.loads(b)), want)
    head, tail = ring._ctrl
    assert head == tail > 6 * one  # every batch freed its space; the ring went round more than twice


@pytest.mark.parametrize("core", ["c", "numpy"])
def test_int64_arrays_travel_narrowed_exactly_when_their_values_fit(core, monkeypatch):
    """In the ring an int64 array goes as int32 when every value fits (checked as it is copied, in
    one pass in C or by numpy's min and max), else as int64; both arrive bitwise as they left."""
    from tokenloom.pipes.loader import wire_ring

    if core == "numpy":
        monkeypatch.setattr(wire_ring, "_narrowcore", None)
    elif wire_ring._narrowcore is None:
        pytest.skip("the C narrowing copy is not built here")
    batch = dict(_batch(4), edge=torch.tensor([2**31 - 1, -2**31]), past=torch.tensor([0, -2**31 - 1]),
                 strided=torch.arange(24).view(4, 6).t(), empty=torch.zeros(0, dtype=torch.int64))
    ring = BatchRing(1 << 20)
    w = WireBatch(batch, ring)
    narrowed = {key: place[3] for key, place, _ in w._placed[2] if place is not None}
    assert narrowed == {"input_ids": True, "labels": True, "segment_ids": False, "big": False, "max_seqlen": False,
                        "edge": True, "past": False, "strided": True, "empty": False}
    _same(unwrap(_through_queue(w)), batch)


def test_a_batch_that_does_not_fit_goes_through_the_pipe():
    ring = BatchRing(1024)
    w = WireBatch(_batch(1), ring)
    assert w._freed_to is None and ring._ctrl[0] == 0
    _same(unwrap(_through_queue(w)), _batch(1))
    full = BatchRing(3 * 1024)
    first = WireBatch({"x": torch.arange(400)}, full)  # 3.2 KB of the 3 KB... narrowed: 1.6 KB
    assert first._freed_to is not None
    second = WireBatch({"x": torch.arange(400)}, full)  # the first is not decoded yet: no room
    assert second._freed_to is None
    _same(unwrap(_through_queue(second)), {"x": torch.arange(400)})
    _same(unwrap(_through_queue(first)), {"x": torch.arange(400)})
    assert WireBatch({"x": torch.arange(400)}, full)._freed_to is not None  # decoded, so freed


def test_a_pickled_ring_is_not_used_and_a_forgotten_ring_says_so():
    ring = BatchRing(1 << 20)
    copy = pickle.loads(pickle.dumps(ring))  # what a spawn or forkserver worker receives
    assert not copy.usable
    w = WireBatch(_batch(2), copy)
    assert w._freed_to is None
    _same(unwrap(_through_queue(w)), _batch(2))
    late = ForkingPickler.dumps(WireBatch(_batch(3), ring))
    del ring, copy  # a new iterator's rings replaced this one: the training process holds it no more
    arrived = pickle.loads(late)  # unpickled inside the queue's get: marked, raised where the loop takes it
    assert arrived == {STALE_KEY: True} and "earlier iterator" in STALE_MESSAGE


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_workers_send_through_their_rings_when_forked(corpus, tok_path, context):
    def batches(workers, **kw):
        loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=1,
                          num_workers=workers, epochs=1, **kw)
        return loader, [b for b in loader]

    loader, got = batches(2, multiprocessing_context=context)
    assert len(got) > 5
    heads = [int(r._ctrl[0]) for r in loader.dataset.rings] if loader.dataset.rings else []
    if context == "fork":
        assert len(heads) == 2 and min(heads) > 0  # both workers wrote their batches into shared memory
    else:
        assert heads == []  # the dataset is pickled into these workers: batches go through the pipe
    ref = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=1, num_workers=2,
                   epochs=1)
    ref.ring_bytes = None
    want = [b for b in ref]
    assert len(want) == len(got)
    for a, b in zip(want, got):
        _same(a, b)


@pytest.mark.parametrize("persistent", [False, True])
def test_flat_snapshots_give_torchdatas_states_at_every_step(corpus, tok_path, monkeypatch, persistent):
    """Worker snapshots kept flat (pipes/compat/torchdata.py) give, at every step and across a
    second round, the very state torchdata's per-step rebuild gives."""
    from tokenloom.pipes.compat import torchdata as snapshot
    from tokenloom.pipes.loader import bridge
    from tokenloom.pipes.loader.bridge import decode_state

    def states(flat: bool):
        if not flat:
            monkeypatch.setattr(bridge, "keep_snapshots_flat", lambda it: it)
        torch.manual_seed(0)  # torchdata draws each iterator's base seed, which the state carries
        loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=255, batch_size=4, buffer_size=16, seed=1,
                          num_workers=2, epochs=1, persistent_workers=persistent)
        out, kinds = [], set()
        for _ in range(2):  # two rounds: the second reuses persistent workers (_reset) or forks new ones
            for _ in iter(loader):
                snap = loader._iterator._snapshot
                kinds.add(type(snap["_worker_snapshots"]).__name__)
                out.append(loader.state_dict())
        # Freed when the loader is, not left to the garbage collector (a reference cycle made
        # the shutdown of persistent workers wait 10 s).
        gc.disable()
        try:
            it = weakref.ref(loader._iterator)
            del loader
            assert it() is None
        finally:
            gc.enable()
        monkeypatch.undo()
        return out, kinds

    def workers(state):
        inner = decode_state(state)["loader"]
        return inner["_snapshot"]["_snapshot_step"], inner["_snapshot"]["_worker_snapshots"]

    flat, flat_kinds = states(True)
    eager, eager_kinds = states(False)
    assert "_FlatWorkers" in flat_kinds and "_FlatWorkers" not in eager_kinds  # the two runs differ in the snapshot
    assert len(flat) == len(eager) > 10
    # The workers' part: the main process's own sampler counters depend on when workers report
    # their end, which varies from run to run with or without flat snapshots.
    assert [workers(s) for s in flat] == [workers(s) for s in eager]
    assert snapshot.nested_snapshot({}) == {}


def test_the_main_state_is_torchdatas_at_every_step(corpus, tok_path):
    """The main state taken with each index (its sampler asked once whether it is Stateful) is,
    at every step and in a second round, what torchdata's own _get_main_state gives."""
    import functools

    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=1, num_workers=2,
                      epochs=1, persistent_workers=True)
    steps = 0
    for _ in range(2):
        for _ in iter(loader):
            it = loader._iterator
            assert isinstance(it._get_main_state, functools.partial)  # installed
            assert it._get_main_state() == type(it)._get_main_state(it)
            steps += 1
    assert steps > 10


def test_flat_snapshots_only_where_torchdata_is_as_expected(corpus, tok_path, monkeypatch):
    """The flat snapshots rely on torchdata internals: they are checked on first use (a changed
    torchdata keeps its own per-step rebuild instead of failing at the first batch)."""
    from tokenloom.pipes.compat import torchdata as snapshot

    assert snapshot.flat_snapshots_ok() and snapshot._internals_as_expected()  # the pinned torchdata
    with monkeypatch.context() as m:  # a torchdata whose _update_snapshot changed
        m.setattr(snapshot._StatefulMultiProcessingDataLoaderIter, "_update_snapshot", lambda self, step: None)
        assert not snapshot._internals_as_expected()
    monkeypatch.setattr(snapshot, "flat_snapshots_ok", lambda: False)
    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=1, num_workers=2)
    it = iter(loader)
    next(it)
    assert type(loader._iterator._snapshot["_worker_snapshots"]) is dict  # torchdata's own, nested
    assert "_get_main_state" not in vars(loader._iterator)  # and its own main state
    assert loader.state_dict()


def test_a_workers_graph_state_reaches_torchdata_as_one_leaf(corpus, tok_path):
    """torchdata diffs each worker's flattened state at every step; the graph's state is one leaf
    (snapshot.WholeState), and the saved state holds it as the plain nested dict."""
    from tokenloom.pipes.loader.bridge import decode_state
    from tokenloom.pipes.compat.torchdata import WholeState

    loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=63, batch_size=2, buffer_size=16, seed=1, num_workers=2)
    it = iter(loader)
    for _ in range(5):
        next(it)
    for w in loader._iterator._snapshot["_worker_snapshots"].values():  # the iterator's state (an IterableDataset)
        assert set(w.iterator) == {("round",), ("node",)} and isinstance(w.iterator[("node",)], WholeState)
    workers = decode_state(loader.state_dict())["loader"]["_snapshot"]["_worker_snapshots"]
    assert all(isinstance(w["fetcher_state"]["dataset_iter_state"]["node"], dict) for w in workers.values())

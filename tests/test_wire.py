"""Batches cross from a worker to the main process as numpy (pipes/loader/wire.py) and come back bitwise."""

from __future__ import annotations

import io
import pickle
from collections import namedtuple
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest
import torch

from tokenloom.pipes.loader.wire import WireBatch, unwrap
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
    assert wire.payload["fits"].array.dtype == np.int32 and wire.payload["huge"].array.dtype == np.int64
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
def test_pin_memory_pins_in_the_pin_thread():
    got = WireBatch({"x": torch.ones(4)}).pin_memory()
    assert got["x"].is_pinned()

"""`DirectQueue` (pipes/compat/mp_queue.py): a small message is written in the caller's
thread, a big one through the feeder thread, and readers see every message whole and in
each writer's order, with writers in several processes and a pipe that fills up."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import queue
import threading

import pytest
import torch

from tokenloom.pipes.compat.mp_queue import DirectForkContext, DirectQueue, direct_context
from tokenloom.recipes import pretrain

from .conftest import synthetic_texts, write_corpus

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="fork start method")


def _message(writer: int, k: int) -> tuple:
    size = (k * 7919) % 200_000 if k % 5 == 0 else k % 300  # mostly small, every fifth up to 200 KB
    payload = os.urandom(size)
    return writer, k, payload, hashlib.sha256(payload).hexdigest()


def _write(q: DirectQueue, writer: int, n: int) -> None:
    for k in range(n):
        q.put(_message(writer, k))


def test_small_messages_are_written_without_a_feeder_thread():
    q = direct_context("fork").Queue()
    for k in range(200):
        q.put(("small", k))
    assert q._thread is None  # no feeder thread was started: every message went straight into the pipe
    assert [q.get(timeout=5) for _ in range(200)] == [("small", k) for k in range(200)]


def test_a_message_that_does_not_fit_goes_through_the_feeder_and_order_holds():
    """And a put after it does not wait for the pipe to empty (this thread is its only reader)."""
    q = direct_context("fork").Queue()
    big = os.urandom(300_000)  # far more than a pipe holds: its put must not block
    tensor = torch.arange(1000)  # torch pickles it into shared memory: once, on the feeder's path too
    q.put(0)
    q.put(big)
    assert q._thread is not None
    for k in range(1, 6):
        q.put(k)
    q.put(tensor)
    got = [q.get(timeout=10) for _ in range(8)]
    assert got[:7] == [0, big, 1, 2, 3, 4, 5] and torch.equal(got[7], tensor)
    handed = q._handed  # the feeder has written all it was given: the next small message goes direct
    q.put("after")
    assert q._handed == handed and q.get(timeout=5) == "after"


def test_writers_in_two_processes_and_a_full_pipe_lose_nothing():
    """Two writer processes, a reader that starts late (the pipe fills) and then reads slowly:
    every message arrives whole, in its writer's order, and nobody waits forever."""
    ctx = DirectForkContext()
    q = ctx.Queue()
    n = 400
    writers = [ctx.Process(target=_write, args=(q, w, n)) for w in range(2)]
    for p in writers:
        p.start()
    seen = {0: [], 1: []}
    for i in range(2 * n):
        writer, k, payload, digest = q.get(timeout=60)
        assert hashlib.sha256(payload).hexdigest() == digest, f"message {k} of writer {writer} arrived corrupt"
        seen[writer].append(k)
    for p in writers:
        p.join(30)
        assert p.exitcode == 0
    assert seen == {0: list(range(n)), 1: list(range(n))}


def test_an_unpicklable_message_raises_in_put():
    """multiprocessing.Queue pickles in its feeder thread: the message is lost with a printed
    traceback and the reader waits forever. Here put itself raises."""
    q = direct_context("fork").Queue()
    with pytest.raises(TypeError, match="pickle"):
        q.put(threading.Lock())
    q.put("next")
    assert q.get(timeout=5) == "next"
    with pytest.raises(queue.Empty):
        q.get(timeout=0.2)


@pytest.mark.parametrize("given", [None, "fork", "forkserver", "spawn"])
def test_the_loader_keeps_the_start_method_and_uses_direct_queues(given, tmp_path, tok_path):
    before = multiprocessing.get_start_method(allow_none=True)
    ctx = direct_context(given)
    assert multiprocessing.get_start_method(allow_none=True) == before  # the default was not fixed
    assert isinstance(ctx.Queue(), DirectQueue)
    want = given or multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    assert ctx.get_start_method() == want
    if given in (None, "fork"):
        write_corpus(str(tmp_path / "d"), synthetic_texts(200, seed=1), files=2, row_group_size=25)
        kwargs = {} if given is None else {"multiprocessing_context": given}
        loader = pretrain(str(tmp_path / "d" / "*.parquet"), tokenizer=tok_path, seq_len=31, batch_size=2,
                          num_workers=2, epochs=1, **kwargs)
        assert isinstance(loader.multiprocessing_context, DirectForkContext)
        assert sum(1 for _ in loader) > 10


def test_a_waiting_message_is_read_without_polling_the_pipe():
    """get(timeout=...) reads a message that is already in the pipe straight away; with nothing
    unread it is multiprocessing's get, which waits and raises Empty."""
    q = direct_context("fork").Queue()
    q.put(("waiting", 1))

    def no_poll(timeout=0.0):
        raise AssertionError("polled although a message was waiting")

    real, q._poll = q._poll, no_poll
    assert q.get(timeout=5) == ("waiting", 1)
    q._poll = real
    with pytest.raises(queue.Empty):
        q.get(timeout=0.1)
    q.put("next")
    assert q.get(timeout=5) == "next"


def test_without_the_pipe_internals_it_is_multiprocessings_queue(monkeypatch, tmp_path, tok_path):
    """Where the pipe cannot be measured (another platform or Python), every put goes through the
    feeder thread and every get is multiprocessing's: the loader's batches are the same."""
    from tokenloom.pipes.compat import mp_queue

    write_corpus(str(tmp_path / "d"), synthetic_texts(200, seed=2), files=2, row_group_size=25)

    def batches():
        loader = pretrain(str(tmp_path / "d" / "*.parquet"), tokenizer=tok_path, seq_len=31, batch_size=2,
                          num_workers=2, epochs=1)
        return [b["input_ids"] for b in loader]

    direct = batches()
    monkeypatch.setattr(mp_queue, "_pipe_capacity", lambda q: None)
    q = direct_context("fork").Queue()
    q.put("through the feeder")
    assert q._capacity is None and q._thread is not None and q.get(timeout=5) == "through the feeder"
    plain = batches()
    assert len(direct) == len(plain) > 10 and all(torch.equal(a, b) for a, b in zip(direct, plain))

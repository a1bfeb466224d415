"""DevicePrefetcher: its state is the last batch handed to the loop, not the last one fetched.

On CPU the prefetcher runs the same queue as on a GPU (``depth`` batches fetched
ahead) without the copies, so resume exactness is checked here on every machine;
the CUDA copy path is checked where a GPU exists.
"""

from __future__ import annotations

import pytest
import torch

from tokenloom.pipes.loader.prefetch import DevicePrefetcher
from tokenloom.recipes import pretrain

from .resume import check_loader_resume, items_equal


def loader_builder(corpus, tok_path, **kw):
    glob, _ = corpus
    args = dict(seq_len=63, batch_size=2, buffer_size=40, seed=7)
    args.update(kw)
    return lambda: pretrain(glob, tokenizer=tok_path, **args)


def prefetched(make_loader, depth=2, device="cpu"):
    return lambda: DevicePrefetcher(make_loader(), device=device, depth=depth)


def take(it, n):
    return [next(it) for _ in range(n)]


def wait_until_full(pf, timeout=30.0):
    """Until the fetch thread holds ``depth`` batches and waits for a free slot (it then leaves the loader alone)."""
    import time

    end = time.monotonic() + timeout
    while pf._fetcher.ready.qsize() < pf.depth:
        assert time.monotonic() < end, "the prefetch thread did not fill its queue"
        time.sleep(0.01)


@pytest.mark.parametrize("num_workers,depth", [(0, 2), (0, 3), (2, 2), (2, 3)])
def test_resume_is_exact_after_each_handed_batch(corpus, tok_path, num_workers, depth):
    make = loader_builder(corpus, tok_path, num_workers=num_workers)
    # The prefetched stream is the loader's stream.
    ref = take(iter(make()), 16)
    got = take(iter(prefetched(make, depth)()), 16)
    assert all(items_equal(a, b) for a, b in zip(ref, got))
    check_loader_resume(prefetched(make, depth), steps=[0, 1, 4, 11], total=16, reference=ref)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_loader_itself_runs_ahead(corpus, tok_path, num_workers):
    """The loader's own state is `depth` batches ahead: resuming from it would skip them.
    (This is what the prefetcher's state exists to avoid; if the queue did not run
    ahead, the test above could not fail.)"""
    make = loader_builder(corpus, tok_path, num_workers=num_workers)
    ref = take(iter(make()), 12)
    pf = prefetched(make, depth=3)()
    it = iter(pf)
    take(it, 4)
    wait_until_full(pf)
    ahead = make()
    ahead.load_state_dict(pf.loader.state_dict())
    assert items_equal(take(iter(ahead), 1)[0], ref[4 + 3])
    exact = make()
    exact.load_state_dict(pf.state_dict())
    assert items_equal(take(iter(exact), 1)[0], ref[4])


def test_stats_describe_the_handed_batches(corpus, tok_path):
    make = loader_builder(corpus, tok_path)
    bare = make()
    bit = iter(bare)
    pf = prefetched(make, depth=3)()
    pit = iter(pf)
    for _ in range(5):
        next(bit), next(pit)
        assert pf.stats() == bare.stats()
    assert pf.stats()["rows"] == 5 * 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_finite_epoch_end_and_next_round(corpus, tok_path, num_workers):
    """epochs=1: saves near the end, at the last batch, and after the loop finished
    resume like the bare loader (the last one into the next round)."""
    make = loader_builder(corpus, tok_path, num_workers=num_workers, epochs=1, seq_len=255, batch_size=8)
    bare = make()
    round1, round2 = list(bare), list(bare)
    n = len(round1)
    assert n > 10 and not items_equal(round1[0], round2[0])
    check_loader_resume(prefetched(make, 2), steps=[n // 2, n - 1, n], reference=round1)

    pf = prefetched(make, 2)()
    assert all(items_equal(a, b) for a, b in zip(list(pf), round1))
    state = pf.state_dict()
    second = list(pf)
    assert len(second) == len(round2) and all(items_equal(a, b) for a, b in zip(second, round2))
    resumed = prefetched(make, 2)()
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == len(round2) and all(items_equal(a, b) for a, b in zip(again, round2))


def test_break_after_the_end_was_fetched_restarts_the_round(corpus, tok_path):
    """The bare loader restarts the current round after a break; so does the prefetcher,
    even when its queue had already fetched the round's end."""
    make = loader_builder(corpus, tok_path, epochs=1, batch_size=8)
    round1 = list(make())
    n = len(round1)
    bare = make()
    take(iter(bare), n - 1)
    bare_restart = take(iter(bare), 2)
    assert all(items_equal(a, b) for a, b in zip(bare_restart, round1))

    pf = prefetched(make, depth=3)()
    take(iter(pf), n - 1)  # the loader has reached its end; the loop has not
    restart = take(iter(pf), 2)
    assert all(items_equal(a, b) for a, b in zip(restart, round1))


def test_load_state_dict_drops_the_queue(corpus, tok_path):
    make = loader_builder(corpus, tok_path)
    ref = take(iter(make()), 10)
    pf = prefetched(make, depth=3)()
    it = iter(pf)
    take(it, 6)
    state = pf.state_dict()
    take(it, 2)
    pf.load_state_dict(state)
    assert pf.state_dict() is state
    with pytest.raises(RuntimeError, match="stale"):
        next(it)
    assert all(items_equal(a, b) for a, b in zip(take(iter(pf), 4), ref[6:10]))


def test_depth_must_be_positive(corpus, tok_path):
    with pytest.raises(ValueError, match="depth=0"):
        DevicePrefetcher(loader_builder(corpus, tok_path)(), device="cpu", depth=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA copy path needs a GPU")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_cuda_batches_land_on_the_device_and_equal_the_cpu_ones(corpus, tok_path, num_workers):
    make = loader_builder(corpus, tok_path, num_workers=num_workers, pin_memory=True)
    ref = take(iter(make()), 10)
    pf = DevicePrefetcher(make(), device="cuda", depth=2)
    it = iter(pf)
    got = []
    for _ in range(6):
        batch = next(it)
        assert all(t.is_cuda for t in batch.values())
        # Work on the current stream must see the finished copy.
        got.append({k: (v * 1).cpu() for k, v in batch.items()})
    assert all(items_equal(a, b) for a, b in zip(ref, got))
    resumed = DevicePrefetcher(make(), device="cuda", depth=2)
    resumed.load_state_dict(pf.state_dict())
    rest = [{k: v.cpu() for k, v in b.items()} for b in take(iter(resumed), 4)]
    assert all(items_equal(a, b) for a, b in zip(ref[6:10], rest))


class Boom:
    """A loader whose third batch raises (what a bad file or a user node does inside the loader)."""

    num_workers = 0

    def __init__(self):
        self.n = 0

    def __iter__(self):
        self.n = 0
        return self

    def __next__(self):
        self.n += 1
        if self.n == 3:
            raise KeyError("row 17 of part-003.parquet has no 'text'")
        return {"x": torch.tensor([self.n])}

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_an_error_in_the_loader_reaches_the_loop_with_its_message():
    it = iter(DevicePrefetcher(Boom(), device="cpu", depth=4))
    assert [int(next(it)["x"]) for _ in range(2)] == [1, 2]
    with pytest.raises(KeyError, match="row 17 of part-003.parquet"):
        next(it)
    with pytest.raises(StopIteration):  # and the iterator stays ended, it does not hang
        next(it)


def test_the_fetch_thread_stops_when_the_loop_drops_its_iterator(corpus, tok_path):
    import gc
    import threading

    pf = prefetched(loader_builder(corpus, tok_path), depth=2)()
    it = iter(pf)
    take(it, 2)
    thread = pf._fetcher
    assert thread.is_alive()
    del it
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert not any(t.name == "tokenloom-prefetch" and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("close", [True, False])
def test_a_dropped_prefetcher_lets_its_workers_go_without_the_cyclic_gc(corpus, tok_path, close):
    """Closed or just dropped, a prefetcher frees its loader by reference counting: worker processes
    a later loader forks must not inherit a live iterator from an earlier one."""
    import gc
    import multiprocessing
    import time

    gc.disable()
    try:
        pf = prefetched(loader_builder(corpus, tok_path, num_workers=2), depth=2)()
        it = iter(pf)
        take(it, 2)
        before = {p.pid for p in multiprocessing.active_children()}
        assert len(before) >= 2
        if close:
            pf.close()
        del it, pf
        deadline = time.monotonic() + 20
        while before & {p.pid for p in multiprocessing.active_children()} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not before & {p.pid for p in multiprocessing.active_children()}
    finally:
        gc.enable()


def test_the_loop_s_previous_batch_is_dropped_in_the_fetch_thread(corpus, tok_path):
    """Destroying tensors releases the GIL, so the batch the loop lets go of is destroyed by the
    prefetch thread, not the training thread (see `_Fetcher.free_slot`)."""
    import threading
    import time
    import weakref

    pf = prefetched(loader_builder(corpus, tok_path), depth=2)()
    freed_in: list = []
    for i, batch in enumerate(pf):
        for t in batch.values():
            if isinstance(t, torch.Tensor):
                weakref.finalize(t, lambda: freed_in.append(threading.current_thread().name))
        if i == 5:
            break
    tensors = sum(isinstance(t, torch.Tensor) for t in batch.values())
    deadline = time.monotonic() + 10
    while len(freed_in) < 5 * tensors and time.monotonic() < deadline:  # batches 0-4; 5 is still held
        time.sleep(0.01)
    assert len(freed_in) == 5 * tensors
    assert set(freed_in) == {"tokenloom-prefetch"}
    del batch
    pf.close()


EXIT_JOB = '''
import torch
from tokenloom.pipes.loader.prefetch import DevicePrefetcher

class Busy:
    """A loader whose every batch takes a while in torch code that releases the GIL."""
    def __iter__(self):
        a = torch.ones(600, 600)
        while True:
            for _ in range(20):
                a = (a @ a).clamp_(max=1.0)
            yield {"x": a[:1].clone()}
    def state_dict(self):
        return {}
    def load_state_dict(self, state):
        pass

it = iter(DevicePrefetcher(Busy(), device="cpu"))
next(it)  # then exit, the prefetcher never closed, its thread fetching the next batch
'''


def test_exit_while_the_thread_fetches(tmp_path):
    """A script that stops iterating and exits while the fetch thread is inside torch code (oracle
    seed 10194, now and then): the daemon thread was ended as it took the GIL back, through C++
    frames, and the process aborted ("terminate called without an active exception", status 134)
    after a good run. The exit hook stops the thread first (fails before: SIGABRT every time here)."""
    import subprocess
    import sys

    job = tmp_path / "exit_job.py"
    job.write_text(EXIT_JOB)
    done = subprocess.run([sys.executable, str(job)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode}: {done.stderr[-2000:]}"

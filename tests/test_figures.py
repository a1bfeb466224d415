"""The figures a training run watches (``loader.figures()``, pipes/loader/wait_clock.py): the wait in
``next()`` is the time ``next()`` takes as the loop sees it; a slow step waits about nothing; a slow
loader is the expected share of the loop's time; the flat dict carries the mix and packing figures."""

from __future__ import annotations

import time

import pytest

from tokenloom.recipes import pretrain

ARGS = dict(seq_len=128, batch_size=4, seed=1)


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    from .conftest import synthetic_texts, write_corpus
    root = tmp_path_factory.mktemp("figures")
    for name, seed in (("web", 1), ("code", 2)):
        write_corpus(str(root / name), synthetic_texts(800, seed=seed, tag=name), files=2, row_group_size=64)
    return {"web": str(root / "web" / "*.parquet"), "code": str(root / "code" / "*.parquet")}


def _drive(loader, steps: int, step_s: float):
    """Run the loop ``steps`` batches with a step of ``step_s``; the time each ``next()`` took and each
    step, as the loop measures them."""
    it = iter(loader)
    waits, stepped = [], []
    for _ in range(steps):
        t = time.perf_counter()
        next(it)
        waits.append(time.perf_counter() - t)
        t = time.perf_counter()
        time.sleep(step_s)
        stepped.append(time.perf_counter() - t)
    return waits, stepped


def test_the_wait_is_the_time_next_takes_and_a_slow_loader_its_share(two_sources, tok_path):
    # Batches of 4,096 tokens take ~3 ms to make here, well above the 1 ms step (with ARGS' 512 a loaded
    # fresh-clone run made them in about the step's time, and the share fell to 0.298).
    loader = pretrain(two_sources, tokenizer=tok_path, num_workers=0, **{**ARGS, "seq_len": 512, "batch_size": 8})
    waits, stepped = _drive(loader, 120, 0.001)  # a step shorter than making a batch
    got = loader.figures()
    assert got["data/first_batch_s"] == pytest.approx(waits[0], rel=0.2, abs=0.005)
    # The loader's clock runs inside next(): its total is the loop's, less the calls' own way in and out
    # (a few us each, more on a loaded machine: a CI run saw 42 us a call, 5 ms over 120 calls).
    total = sum(waits)
    assert total - 0.005 - 1e-4 * len(waits) <= got["data/wait_total_s"] <= total + 0.001, (got, total)
    window = waits[-100:]
    assert got["data/wait_ms"] == pytest.approx(1e3 * sum(window) / len(window), rel=0.1, abs=0.2)
    expected = sum(window) / (sum(window) + sum(stepped[-101:-1]))  # the loop's time: the making of each batch
    assert got["data/wait_share"] == pytest.approx(expected, abs=0.05)
    assert got["data/wait_share"] > 0.3, "with num_workers=0 the loop makes every batch: a large share"
    assert got["data/wait_p99_ms"] >= got["data/wait_ms"]


def test_a_slow_step_waits_about_nothing(two_sources, tok_path):
    loader = pretrain(two_sources, tokenizer=tok_path, num_workers=2, **ARGS)
    _drive(loader, 80, 0.06)
    got = loader.figures()
    # what is left is receiving a batch from a worker (README: ~2-4 ms here without DevicePrefetcher; more
    # on a loaded machine), against a slow loader's 0.3 and more (the test above)
    assert got["data/wait_share"] < 0.2, got
    assert got["data/wait_ms"] < 12.0, got
    # the workers are ahead: batches wait for the loop, up to num_workers * prefetch_factor
    assert 1 <= got["data/batches_ready"] <= 2 * loader.prefetch_factor, got


def test_batches_ready_is_left_out_where_it_cannot_be_read(two_sources, tok_path, monkeypatch):
    from tokenloom.pipes.compat import torchdata as compat
    loader = pretrain(two_sources, tokenizer=tok_path, num_workers=0, **ARGS)
    _drive(loader, 3, 0)
    assert "data/batches_ready" not in loader.figures(), "no workers, nothing ready ahead"
    assert compat.batches_ready(object()) is None  # an iterator that keeps other fields: the fallback
    workers = pretrain(two_sources, tokenizer=tok_path, num_workers=1, **ARGS)
    _drive(workers, 3, 0)
    monkeypatch.setattr(compat.current_iterator(workers), "_task_info", None)  # torchdata changed its fields
    assert "data/batches_ready" not in workers.figures() and "data/wait_ms" in workers.figures()


def test_the_flat_figures_carry_the_mix_and_the_rate(two_sources, tok_path):
    loader = pretrain(two_sources, tokenizer=tok_path, weights={"web": 0.7, "code": 0.3}, num_workers=0, **ARGS)
    it = iter(loader)
    for _ in range(5):
        next(it)
    first = loader.figures(prefix="loader/")
    assert "loader/tokens_per_s" not in first, "no rate before a second call"
    for _ in range(30):
        next(it)
    got = loader.figures(prefix="loader/")
    assert got["loader/target/web"] == 0.7 and got["loader/target/code"] == 0.3
    assert got["loader/share/web"] + got["loader/share/code"] == pytest.approx(1.0)
    assert got["loader/tokens_per_s"] > 0
    assert 0 <= got["loader/padding"] < 1 and got["loader/discarded"] == 0
    assert all(isinstance(v, float) for v in got.values()), "loggers take floats"
    stats = loader.stats()
    assert got["loader/share/web"] == pytest.approx(stats["sources"]["web"]["share"])


def test_a_new_iterator_starts_no_step_across_the_gap(two_sources, tok_path):
    loader = pretrain(two_sources, tokenizer=tok_path, num_workers=0, **ARGS)
    it = iter(loader)
    for _ in range(3):
        next(it)
    time.sleep(0.3)  # the loop away: an evaluation, a checkpoint
    it = iter(loader)
    next(it)
    next(it)
    got = loader.figures()
    assert got["data/wait_share"] > 0.2, "the 0.3 s away is not a step"


def test_behind_a_prefetcher_its_figures_time_the_loop_not_the_prefetch_thread(two_sources, tok_path):
    from tokenloom.pipes.loader.prefetch import DevicePrefetcher
    loader = pretrain(two_sources, tokenizer=tok_path, num_workers=0, **ARGS)
    batches = DevicePrefetcher(loader, device="cpu", depth=2)
    it = iter(batches)
    for _ in range(60):
        next(it)
        time.sleep(0.02)  # a step far longer than making a batch: the thread keeps ahead
    got = batches.figures()
    assert got["data/wait_share"] < 0.1, got
    # the loader's own clock times the prefetch thread's next(), which makes every batch here
    assert loader.wait_clock.batches > batches.wait_clock.batches >= 60
    assert got["data/share/web"] == loader.figures()["data/share/web"]

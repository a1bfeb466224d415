"""Progress of a finite epoch in `loader.stats()` (issue 14): per source ``passes``, and
``progress = {"fraction", "batches_left"}`` a progress bar can take its total from.

The corpora have moderate length spread (word counts uniform in a range), so the
rows-for-tokens estimate is judged on its own bias, not on a heavy tail's noise; the
packer's buffer is small against a shard so documents are held back and the
correction for them is exercised.
"""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

from tokenloom.cli import main
from tokenloom.pipes import plan_epoch
from tokenloom.pipes.loader.rank_sync import ThreadSync
from tokenloom.recipes import pretrain
from tokenloom.recipes.packed_stats import PackedStatsView

from .conftest import WORDS, write_corpus

#: How far the estimates may be off at the middle of a round (batches_left relative, fraction absolute).
LEFT_TOLERANCE = 0.25
FRACTION_TOLERANCE = 0.1


def spread_texts(n: int, lo: int, hi: int, tag: str, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [f"{tag}{i:05d} " + " ".join(rng.choice(WORDS, int(k))) for i, k in enumerate(rng.integers(lo, hi, n))]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("progress")
    write_corpus(str(root / "long"), spread_texts(1200, 20, 200, "l", 1))
    write_corpus(str(root / "short"), spread_texts(1500, 3, 30, "s", 2))
    return {"long": str(root / "long" / "*.parquet"), "short": str(root / "short" / "*.parquet")}


def progress_after_each_batch(loader, it=None):
    out = []
    for _ in it if it is not None else loader:
        s = loader.stats()
        out.append((s["progress"]["fraction"], s["progress"]["batches_left"], {n: v["passes"] for n, v in s["sources"].items()}))
    return out


def check_round(seen, what, rows_like_batches=True):
    """Rising fraction, 1.0 and 0 left at the last batch, sensible figures at the middle.
    ``fraction`` counts rows, which follow batches unless sources of different document
    lengths each deliver all their rows (then only ``batches_left`` follows batches)."""
    n = len(seen)
    fractions = [f for f, _, _ in seen]
    assert all(a <= b for a, b in zip(fractions, fractions[1:])), f"{what}: the fraction went down: {fractions}"
    assert seen[-1][:2] == (1.0, 0), f"{what}: the last of {n} batches reports {seen[-1][:2]}"
    mid = n // 2
    fraction, left, _ = seen[mid - 1]
    truth = n - mid
    assert not rows_like_batches or abs(fraction - mid / n) < FRACTION_TOLERANCE, f"{what}: fraction {fraction:.3f} at batch {mid} of {n}"
    assert left is not None and abs(left - truth) <= LEFT_TOLERANCE * truth, (
        f"{what}: {left} batches left at batch {mid} of {n} (truly {truth})")


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("epochs", [1, 2])
def test_progress_of_a_finite_epoch(sources, tok_path, num_workers, epochs):
    loader = pretrain(sources["long"], tokenizer=tok_path, seq_len=128, batch_size=4, buffer_size=64,
                      epochs=epochs, num_workers=num_workers)
    before = loader.stats()
    assert before["progress"] == {"fraction": 0.0, "batches_left": None}
    assert before["sources"]["default"]["passes"] == 0.0
    for round_ in range(2):  # the second round counts from 0 again (the first round's rows are not in it)
        seen = progress_after_each_batch(loader)
        check_round(seen, f"{num_workers=} {epochs=} round {round_}")
        assert seen[-1][2] == {"default": float(epochs)}, "every row of this rank delivered, once per epoch"
        assert seen[0][0] < FRACTION_TOLERANCE
        # After the loop saw the round end: done, nothing left.
        assert loader.stats()["progress"] == {"fraction": 1.0, "batches_left": 0}


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop,cycle", [("all_exhausted", False), ("all_exhausted", True), ("first_exhausted", False)])
def test_progress_of_two_mixed_sources(sources, tok_path, num_workers, stop, cycle):
    loader = pretrain(sources, tokenizer=tok_path, weights={"long": 0.5, "short": 0.5}, seq_len=128, batch_size=4,
                      buffer_size=64, epochs=1, stop=stop, cycle_exhausted=cycle, num_workers=num_workers)
    seen = progress_after_each_batch(loader)
    check_round(seen, f"{stop=} {cycle=} {num_workers=}", rows_like_batches=cycle or stop == "first_exhausted")
    passes = seen[-1][2]
    if stop == "first_exhausted":
        assert max(passes.values()) == 1.0 and min(passes.values()) < 1.0, passes
    elif cycle:  # the slowest source ends the stream, the other cycled on
        assert min(passes.values()) == 1.0 and max(passes.values()) > 1.0, passes
    else:
        assert passes == {"long": 1.0, "short": 1.0}


def test_rank_padding_reports_the_end(corpus, tok_path):
    """A rank whose data ended yields padding batches while the other goes on: 1.0 and 0 left."""
    sync = ThreadSync(2)
    out = {}

    def run(rank):
        loader = pretrain(corpus[0], tokenizer=tok_path, seq_len=255, batch_size=4, epochs=1, rank=rank,
                          world_size=2, rank_sync=sync, seed=11)
        seen = []
        for b in loader:
            s = loader.stats()
            seen.append((bool((b["labels"] == -100).all()), s["progress"]["fraction"], s["progress"]["batches_left"]))
        out[rank] = seen

    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert set(out) == {0, 1}, "a rank did not finish"
    padded = [r for r in (0, 1) if out[r][-1][0]]
    assert padded, "this corpus gives the ranks unequal batch counts (test_ranks.py); one of them must have padded"
    for r in (0, 1):
        data = [x for x in out[r] if not x[0]]
        assert data[-1][1:] == (1.0, 0), f"rank {r}: its last data batch reports {data[-1][1:]}"
        assert all(x[1:] == (1.0, 0) for x in out[r][len(data):]), f"rank {r} while padding: {out[r][len(data):]}"


def test_a_resumed_loader_reports_the_same_stats(sources, tok_path):
    def build():
        return pretrain(sources, tokenizer=tok_path, weights={"long": 0.5, "short": 0.5}, seq_len=128, batch_size=4,
                        buffer_size=64, epochs=1, stop="all_exhausted", cycle_exhausted=False, num_workers=2)

    loader = build()
    whole, states = [], {}
    for i, _ in enumerate(loader):
        whole.append(loader.stats())
        if i + 1 in (1, 57):
            states[i + 1] = loader.state_dict()
    for step, state in states.items():
        resumed = build()
        resumed.load_state_dict(state)
        assert resumed.stats() == whole[step - 1], f"after loading the state of step {step}"
        assert resumed.stats()["progress"]["fraction"] > 0, whole[step - 1]["progress"]
        for i, _ in enumerate(resumed, start=step):
            assert resumed.stats() == whole[i], f"resumed at step {step}: stats differ at step {i + 1}"
        assert i + 1 == len(whole)


def test_endless_runs_count_passes_without_a_total(sources, tok_path):
    loader = pretrain(sources["short"], tokenizer=tok_path, seq_len=128, batch_size=8, num_workers=0)
    passes = []
    for _ in loader:
        s = loader.stats()
        assert s["progress"] == {"fraction": None, "batches_left": None}
        passes.append(s["sources"]["default"]["passes"])
        if passes[-1] > 1.5:
            break
    assert passes == sorted(passes) and passes[-1] > 1.5, passes[-5:]


@pytest.mark.parametrize("total,world_size,num_workers", [(1500, 1, 0), (1501, 3, 2), (997, 4, 3), (64, 8, 8)])
def test_rank_rows_match_the_sharder(total, world_size, num_workers):
    units = np.full(total // 7 + 1, 7)
    units[-1] = total - 7 * (len(units) - 1)
    n = max(num_workers, 1)
    for rank in range(world_size):
        planned = sum(s.hi - s.lo for g in range(rank * n, rank * n + n)
                      for s in plan_epoch(units, seed=3, epoch=0, shard=g, num_shards=world_size * n))
        assert PackedStatsView.rank_rows(total, rank, world_size, num_workers) == planned, (rank, world_size, n)


def test_run_to_the_end_of_an_epoch_shows_an_estimated_total(sources, capsys):
    """``tokenloom run --epochs 1`` without --steps: the bar's total is the estimate, ~N."""
    assert main(["run", sources["long"], "--tokenizer", "demo", "--seq-len", "128", "--batch-size", "4",
                 "--buffer-size", "64", "--epochs", "1"]) == 0
    bars = [line for line in capsys.readouterr().err.splitlines() if line.startswith("pretrain [")]
    totals = [re.search(r" (\d+)/~(\d+) batches", line) for line in bars]
    assert len(bars) >= 10 and all(totals), bars  # a plain line every 10% (stderr is not a terminal)
    done, total = totals[-1].groups()
    assert done == total, f"the last line must show the end: {bars[-1]}"

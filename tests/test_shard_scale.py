"""Sharding at scale, on paper: 200,000 row groups on 1000 ranks x 8 workers, no files.

Goes through the real planner (`plan_shards`, which `ShardUnits` calls for its own
shard) and checks that every row of every unit is owned by exactly one shard and
that shards are balanced by rows. An independent row-by-row reference checks the
planner on small random inputs.
"""

from __future__ import annotations

import time

import numpy as np
from hypothesis import given, settings, strategies as st

from tokenloom.pipes import ShardContext, ShardUnits, plan_epoch, plan_shards


def _shard_of_each_slice(start: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(len(start) - 1), np.diff(start))


def test_200k_row_groups_on_1000_ranks_by_8_workers():
    rng = np.random.default_rng(7)
    # Row groups of very different sizes: mostly ~1k-100k rows, a long tail, some tiny.
    rows = np.maximum(1, rng.lognormal(8.5, 1.5, 200_000)).astype(np.int64)
    world, workers = 1000, 8
    num_shards = world * workers

    t0 = time.perf_counter()
    plan = plan_shards(rows, seed=3, epoch=0, num_shards=num_shards)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5, f"planning {num_shards} shards of {len(rows)} units took {elapsed:.1f}s"

    # every row of every unit owned exactly once: per unit, slices tile [0, rows) without gaps or overlaps
    by_unit = np.lexsort((plan.lo, plan.unit))
    unit, lo, hi = plan.unit[by_unit], plan.lo[by_unit], plan.hi[by_unit]
    assert (hi > lo).all()
    first = np.concatenate([[True], unit[1:] != unit[:-1]])
    last = np.concatenate([unit[1:] != unit[:-1], [True]])
    assert np.array_equal(np.unique(unit), np.arange(len(rows))), "a unit is missing from the plan"
    assert (lo[first] == 0).all(), "a unit's first rows are owned by nobody"
    assert np.array_equal(hi[last], rows[unit[last]]), "a unit's last rows are owned by nobody"
    assert np.array_equal(lo[~first], hi[:-1][~first[1:]]), "rows of a unit are skipped or owned twice"
    assert int((plan.hi - plan.lo).sum()) == int(rows.sum())

    # balanced by rows: within one row of each other (far inside 1%)
    per_shard = np.bincount(_shard_of_each_slice(plan.start), weights=plan.hi - plan.lo, minlength=num_shards)
    mean = rows.sum() / num_shards
    assert per_shard.max() - per_shard.min() <= 1
    assert (per_shard.max() - per_shard.min()) / mean < 0.01
    # ... and each shard opens few units (a shard's rows are consecutive in the epoch order)
    units_per_shard = np.diff(plan.start)
    assert units_per_shard.max() <= 2 + int(mean // rows.min()) and units_per_shard.mean() < 30

    # what a worker's ShardUnits node reads is exactly its shard of the all-shards plan
    for rank, worker in ((0, 0), (540, 3), (999, 7)):
        g = ShardContext(rank, world, worker, workers).shard
        node = ShardUnits(rows, shard=g, num_shards=num_shards, seed=3, epochs=1)
        node.reset(None)
        assert list(node) == plan.slices(g), f"rank {rank} worker {worker}"


def _reference(rows, num_shards, order):
    """Row by row: lay the units' rows end to end in ``order``; row p belongs to the
    shard g with g*R//S <= p < (g+1)*R//S. Returns {shard: [(unit, lo, hi), ...]}."""
    total = sum(rows)
    out = {g: [] for g in range(num_shards)}
    p = 0
    for u in order:
        for r in range(rows[u]):
            g = next(g for g in range(num_shards) if g * total // num_shards <= p < (g + 1) * total // num_shards)
            if out[g] and out[g][-1][0] == u and out[g][-1][2] == r:
                out[g][-1] = (u, out[g][-1][1], r + 1)
            else:
                out[g].append((u, r, r + 1))
            p += 1
    return out


@settings(max_examples=80, deadline=None)
@given(rows=st.lists(st.integers(0, 9), max_size=25), num_shards=st.integers(1, 12), epoch=st.integers(0, 2))
def test_planner_matches_a_row_by_row_reference(rows, num_shards, epoch):
    rows_arr = np.asarray(rows, dtype=np.int64)
    order = np.arange(len(rows))  # unshuffled, so the reference knows the order
    want = _reference(rows, num_shards, order)
    every = plan_shards(rows_arr, seed=0, epoch=epoch, num_shards=num_shards, shuffle=False)
    for g in range(num_shards):
        got = [(s.unit, s.lo, s.hi) for s in plan_epoch(rows_arr, seed=0, epoch=epoch, shard=g,
                                                           num_shards=num_shards, shuffle=False)]
        assert got == want[g], f"shard {g}"
        assert every.slices(g) == plan_epoch(rows_arr, seed=0, epoch=epoch, shard=g, num_shards=num_shards,
                                             shuffle=False)
    # a contiguous range of shards gives the same slices as planning them one by one (shuffled)
    lo_g = num_shards // 3
    part = plan_shards(rows_arr, seed=5, epoch=epoch, num_shards=num_shards, shards=range(lo_g, num_shards))
    for g in range(lo_g, num_shards):
        assert part.slices(g) == plan_epoch(rows_arr, seed=5, epoch=epoch, shard=g, num_shards=num_shards)

"""The sharder: which rows of which work units one (rank, worker) reads, epoch by epoch.

A work unit is a contiguous block of rows that can be read on its own (a parquet
row group, a slice of a jsonl file). Each epoch the units are put in a seeded
random order and their rows laid end to end, giving one global row range
``[0, R)``. With ``S = world_size * num_workers`` shards, shard ``g = rank *
num_workers + worker`` owns rows ``[g*R//S, (g+1)*R//S)``: disjoint, covering,
and balanced to one row whatever the unit sizes. A shard's rows fall in a few
consecutive units, so it opens few files; the order of units (and of rows inside
a unit, see the reader) changes every epoch.

Balancing by rows instead of by whole units matters when units are few or uneven:
4 files of one row group each on 8 shards would leave half the shards idle under
unit-level round robin; here every shard gets R/8 rows.

The plan depends only on (unit sizes, seed, epoch, S, g), so any process can
recompute it: the sharder's state is just (epoch, index of the next slice).
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional

import numpy as np

from .base import Node

# Tags keep the random streams of different purposes apart for the same seed.
UNIT_ORDER_TAG = 0x5A1
ROW_ORDER_TAG = 0x20E


def rng_for(seed: int, *parts: int) -> np.random.Generator:
    """A generator determined only by (seed, *parts): no global RNG state anywhere."""
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *map(int, parts)]))


class WorkSlice(NamedTuple):
    """Rows ``[lo, hi)`` (in the epoch's row order of the unit) of unit ``unit``."""

    epoch: int
    unit: int
    lo: int
    hi: int


def plan_epoch(unit_rows: np.ndarray, *, seed: int, epoch: int, shard: int, num_shards: int,
               shuffle: bool = True) -> List[WorkSlice]:
    """The slices shard ``shard`` of ``num_shards`` reads in ``epoch`` (see module docstring)."""
    n = len(unit_rows)
    order = rng_for(seed, UNIT_ORDER_TAG, epoch).permutation(n) if shuffle else np.arange(n)
    cum = np.concatenate([[0], np.cumsum(unit_rows[order], dtype=np.int64)])
    total = int(cum[-1])
    lo_g = shard * total // num_shards
    hi_g = (shard + 1) * total // num_shards
    if hi_g <= lo_g:
        return []
    first = int(np.searchsorted(cum, lo_g, side="right")) - 1
    last = int(np.searchsorted(cum, hi_g, side="left"))
    out = []
    for i in range(first, last):
        a = max(lo_g, int(cum[i])) - int(cum[i])
        b = min(hi_g, int(cum[i + 1])) - int(cum[i])
        if b > a:
            out.append(WorkSlice(epoch, int(order[i]), a, b))
    return out


def check_shardable(total_rows: int, num_shards: int, what: str) -> None:
    """Every shard must own at least one row, or an endless epoch would spin on nothing."""
    if total_rows < num_shards:
        raise ValueError(
            f"{what} has {total_rows} rows but there are {num_shards} shards "
            "(world_size * num_workers); every shard needs at least one row. "
            "Use fewer loader workers or add data."
        )


class ShardUnits(Node[WorkSlice]):
    """Emits the `WorkSlice`s of one shard, epoch after epoch.

    ``epochs=None`` cycles forever; ``epochs=n`` stops after epochs
    ``first_epoch .. first_epoch + n - 1``.
    """

    EPOCH = "epoch"
    INDEX = "index"
    STATE_KEYS = (EPOCH, INDEX)

    def __init__(self, unit_rows: np.ndarray, *, shard: int, num_shards: int, seed: int,
                 epochs: Optional[int] = None, first_epoch: int = 0, shuffle: bool = True,
                 what: str = "the corpus"):
        super().__init__()
        if not 0 <= shard < num_shards:
            raise ValueError(f"{shard=} must be in [0, {num_shards=})")
        if epochs is not None and epochs < 1:
            raise ValueError(f"{epochs=} must be None (endless) or >= 1")
        self.unit_rows = np.asarray(unit_rows, dtype=np.int64)
        check_shardable(int(self.unit_rows.sum()), num_shards, what)
        self.shard, self.num_shards, self.seed = shard, num_shards, seed
        self.epochs, self.first_epoch, self.shuffle = epochs, first_epoch, shuffle
        self._epoch = first_epoch
        self._index = 0
        self._plan: Optional[List[WorkSlice]] = None

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        if initial_state is None:
            self._epoch, self._index = self.first_epoch, 0
        else:
            self._epoch, self._index = int(initial_state[self.EPOCH]), int(initial_state[self.INDEX])
        self._plan = None

    def _finished(self) -> bool:
        return self.epochs is not None and self._epoch >= self.first_epoch + self.epochs

    def next(self) -> WorkSlice:
        while not self._finished():
            if self._plan is None:
                self._plan = plan_epoch(self.unit_rows, seed=self.seed, epoch=self._epoch, shard=self.shard,
                                        num_shards=self.num_shards, shuffle=self.shuffle)
            if self._index < len(self._plan):
                item = self._plan[self._index]
                self._index += 1
                return item
            self._epoch, self._index, self._plan = self._epoch + 1, 0, None
        raise StopIteration

    def get_state(self) -> Dict[str, Any]:
        return {self.EPOCH: self._epoch, self.INDEX: self._index}

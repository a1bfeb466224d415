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

Planning is vectorized (`plan_shards`): no Python loop over units or shards. Each
worker plans only its own shard, once per epoch; the cost is the unit permutation
and a cumulative sum. Planning all 8,000 shards of 1000 ranks x 8 workers at once
(what `tests/test_shard_scale.py` checks) is one permutation and one cumulative sum
too, not one per shard.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence

import numpy as np

from .base import Node
from .roles import SHARD

# Tags keep the random streams of different purposes apart for the same seed.
UNIT_ORDER_TAG = 0x5A1
ROW_ORDER_TAG = 0x20E


def rng_for(seed: int, *parts: int) -> np.random.Generator:
    """A generator determined only by (seed, *parts): no global RNG state anywhere."""
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, *map(int, parts)]))


class WorkSlice(NamedTuple):
    """Rows ``[lo, hi)`` (in the epoch's row order of the unit) of unit ``unit``.

    ``used`` > 0 only in an elastic resume's prefix: a one-row slice whose document had
    its first ``used`` tokens delivered before the resume (see elastic.py)."""

    epoch: int
    unit: int
    lo: int
    hi: int
    used: int = 0


class EpochPlan(NamedTuple):
    """The slices of shards ``first .. first + len(start) - 2`` in one epoch, as parallel
    arrays: slice ``k`` is rows ``[lo[k], hi[k])`` of unit ``unit[k]``; shard ``g`` reads
    slices ``start[g - first] .. start[g - first + 1] - 1``, in that order."""

    epoch: int
    first: int
    unit: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    start: np.ndarray

    def slices(self, shard: int) -> List[WorkSlice]:
        a, b = int(self.start[shard - self.first]), int(self.start[shard - self.first + 1])
        return [WorkSlice(self.epoch, u, lo, hi)
                for u, lo, hi in zip(self.unit[a:b].tolist(), self.lo[a:b].tolist(), self.hi[a:b].tolist())]


def _shard_bounds(total: int, num_shards: int, first: int, stop: int) -> np.ndarray:
    """``g * total // num_shards`` for ``g`` in ``[first, stop]``, exact even past int64."""
    if total * num_shards < 2 ** 62:
        return np.arange(first, stop + 1, dtype=np.int64) * total // num_shards
    return np.asarray([g * total // num_shards for g in range(first, stop + 1)], np.int64)


def plan_shards(unit_rows: np.ndarray, *, seed: int, epoch: int, num_shards: int, shards: Optional[range] = None,
                shuffle: bool = True) -> EpochPlan:
    """The slices of ``shards`` (default: all ``num_shards``) in ``epoch`` (see the module docstring).

    Unit boundaries and shard boundaries are two sorted lists of positions in the
    epoch's row range; merged, each gap between neighbours is one slice, and two
    binary searches say whose unit and whose shard it is. Only the unit boundaries
    inside the requested shards take part, so one shard costs the unit permutation
    and a cumulative sum, and all shards at once cost one merge more.
    """
    shards = range(num_shards) if shards is None else shards
    if shards.step != 1 or not 0 <= shards.start <= shards.stop <= num_shards:
        raise ValueError(f"{shards=} must be a contiguous range inside [0, {num_shards=}]")
    rows = np.asarray(unit_rows, dtype=np.int64)
    n = len(rows)
    order = rng_for(seed, UNIT_ORDER_TAG, epoch).permutation(n) if shuffle else np.arange(n)
    cum = np.zeros(n + 1, np.int64)
    np.cumsum(rows[order], out=cum[1:])
    bounds = _shard_bounds(int(cum[-1]), num_shards, shards.start, shards.stop)
    inner = cum[np.searchsorted(cum, bounds[0], "right"):np.searchsorted(cum, bounds[-1], "left")]
    points = np.concatenate([inner, bounds])
    points.sort(kind="stable")  # two sorted runs: a linear merge
    points = points[np.concatenate([[True], points[1:] != points[:-1]])]
    a, b = points[:-1], points[1:]
    pos = np.searchsorted(cum, a, side="right") - 1  # the last unit starting at or before a: skips empty ones
    shard = np.searchsorted(bounds, a, side="right") - 1
    start = np.searchsorted(shard, np.arange(len(shards) + 1), side="left")
    return EpochPlan(epoch, shards.start, order[pos], a - cum[pos], b - cum[pos], start)


def plan_epoch(unit_rows: np.ndarray, *, seed: int, epoch: int, shard: int, num_shards: int,
               shuffle: bool = True) -> List[WorkSlice]:
    """The slices shard ``shard`` of ``num_shards`` reads in ``epoch`` (see module docstring)."""
    return plan_shards(unit_rows, seed=seed, epoch=epoch, num_shards=num_shards, shards=range(shard, shard + 1),
                       shuffle=shuffle).slices(shard)


class EpochPlans:
    """Every shard's slices, one `plan_shards` call per epoch, kept: what an elastic resume reads of
    all the old shards at once (a `ShardUnits` given ``plans=`` takes its slices from here instead of
    permuting the units itself: one permutation an epoch for all the shards, where single-shard
    plans cost a permutation each)."""

    def __init__(self, unit_rows: np.ndarray, *, seed: int, num_shards: int, shuffle: bool = True):
        self.unit_rows = np.asarray(unit_rows, dtype=np.int64)
        self.seed, self.num_shards, self.shuffle = seed, num_shards, shuffle
        self._plans: Dict[int, EpochPlan] = {}

    def slices(self, epoch: int, shard: int) -> List[WorkSlice]:
        plan = self._plans.get(epoch)
        if plan is None:
            plan = self._plans[epoch] = plan_shards(self.unit_rows, seed=self.seed, epoch=epoch,
                                                    num_shards=self.num_shards, shuffle=self.shuffle)
        return plan.slices(shard)


def unread_after(parent: "ShardUnits", current: Optional[WorkSlice], done: int, upto_epoch: int) -> List[WorkSlice]:
    """What a reader has not read yet of epochs up to ``upto_epoch``: the rest of its current
    slice (``done`` rows of it read) and the slices its sharder has not emitted. A reader
    restored at a slice's start with rows to skip passes ``current=None`` and ``done`` = the
    skip; its sharder then still holds that slice."""
    rest = parent.unread(upto_epoch)
    if current is None:
        if done and rest:
            first = rest[0]
            rest[0] = first._replace(lo=first.lo + done)
        return [s for s in rest if s.hi > s.lo]
    head = [current._replace(lo=current.lo + done)] if current.lo + done < current.hi else []
    return (head if current.epoch <= upto_epoch else []) + rest


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

    After an elastic resume (another world size or worker count, see elastic.py) a shard
    first emits ``prefix``, its share of what the old shards had left of their epochs,
    then plans normally from ``resume_epoch`` on. ``PREFIX`` counts the prefix slices
    emitted.

    Args:
        unit_rows: rows per work unit of the source (int64, one entry a unit).
        shard: this shard's number ``g = rank * num_workers + worker``, in ``[0, num_shards)``.
        num_shards: ``S = world_size * num_workers``; every shard must own at least one row.
        seed: seeds the unit order of every epoch (with the epoch number).
        epochs: passes to make (None: cycle forever).
        first_epoch: the epoch number of the first pass.
        shuffle: put the units in a seeded random order each epoch (False: file order).
        what: names the source in the error raised when it has fewer rows than shards.
        prefix: an elastic resume's share of what the old shards had left, emitted first.
        resume_epoch: the epoch planning resumes at after ``prefix`` (None: ``first_epoch``, not resumed).
        prefix_offset: the number of ``prefix[0]`` among the plan's prefix slices (a saved plan drops
            those no restore can need again).
        plans: a shared `EpochPlans` to take this shard's slices from (its shard count, seed and
            shuffle must match); None: plan this shard alone.

    State keys: ``EPOCH`` (the epoch being planned), ``INDEX`` (the next slice's index in that
    epoch's plan) and ``PREFIX`` (prefix slices emitted, counted from the plan's first). The plan
    itself is recomputed from (unit sizes, seed, epoch, shards, shard), never saved.
    """
    ROLE = SHARD

    EPOCH = "epoch"
    INDEX = "index"
    PREFIX = "prefix"
    STATE_KEYS = (EPOCH, INDEX, PREFIX)

    def __init__(self, unit_rows: np.ndarray, *, shard: int, num_shards: int, seed: int,
                 epochs: Optional[int] = None, first_epoch: int = 0, shuffle: bool = True,
                 what: str = "the corpus", prefix: Sequence[WorkSlice] = (), resume_epoch: Optional[int] = None,
                 prefix_offset: int = 0, plans: Optional[EpochPlans] = None):
        super().__init__()
        if not 0 <= shard < num_shards:
            raise ValueError(f"{shard=} must be in [0, {num_shards=})")
        if epochs is not None and epochs < 1:
            raise ValueError(f"{epochs=} must be None (endless) or >= 1")
        self.unit_rows = np.asarray(unit_rows, dtype=np.int64)
        if plans is None:
            check_shardable(int(self.unit_rows.sum()), num_shards, what)
        elif (plans.num_shards, plans.seed, plans.shuffle) != (num_shards, seed, shuffle):
            raise ValueError(f"plans= is for {plans.num_shards} shards, seed {plans.seed}, shuffle {plans.shuffle}; "
                             f"this sharder has {num_shards=}, {seed=}, {shuffle=}")
        self.plans = plans
        self.shard, self.num_shards, self.seed = shard, num_shards, seed
        self.epochs, self.first_epoch, self.shuffle = epochs, first_epoch, shuffle
        self.continue_plan(prefix, resume_epoch, prefix_offset)

    def continue_plan(self, prefix: Sequence[WorkSlice] = (), resume_epoch: Optional[int] = None,
                      prefix_offset: int = 0) -> None:
        """Emit ``prefix`` first, then plan from ``resume_epoch`` on: a new shard's share of an elastic
        resume (elastic.py `prefix_of` gives these for a source; the loader calls this on every sharder
        of a graph built for such a shard, so a graph composed by hand continues like a recipe's).
        Before `reset`; the same arguments twice change nothing."""
        # A saved plan drops the prefix slices no restore can need again: prefix[0] is slice
        # number prefix_offset, and PREFIX counts from the plan's first slice.
        self.prefix = [s if type(s) is WorkSlice else WorkSlice(*s) for s in prefix]
        self.prefix_offset = int(prefix_offset)
        self._end = self.prefix_offset + len(self.prefix)
        self.start_epoch = self.first_epoch if resume_epoch is None else int(resume_epoch)
        self.resumed = resume_epoch is not None
        self._epoch = self.start_epoch
        self._index = 0
        self._pre = 0
        self._plan: Optional[List[WorkSlice]] = None
        self._unstartable = False

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        # Restarting a round whose handed-over work is partly used up is refused at the first slice, not
        # here: torch's single-process iterator resets a dataset before it loads the state it resumes.
        self._unstartable = initial_state is None and self.prefix_offset > 0
        if initial_state is None:
            self._epoch, self._index, self._pre = self.start_epoch, 0, self.prefix_offset
        else:
            self._epoch, self._index = int(initial_state[self.EPOCH]), int(initial_state[self.INDEX])
            self._pre = int(initial_state[self.PREFIX])
            if not (self.prefix_offset <= self._pre <= self._end) and (self.prefix or self._pre):
                raise ValueError(f"ShardUnits: the state has emitted {self._pre} prefix slices, the plan holds "
                                 f"{self.prefix_offset}..{self._end}; it was saved by another elastic resume plan")
        self._plan = None

    def _finished(self) -> bool:
        return self.epochs is not None and self._epoch >= self.first_epoch + self.epochs

    def _plan_of(self, epoch: int) -> List[WorkSlice]:
        if self.plans is not None:
            return self.plans.slices(epoch, self.shard)
        return plan_epoch(self.unit_rows, seed=self.seed, epoch=epoch, shard=self.shard,
                          num_shards=self.num_shards, shuffle=self.shuffle)

    def unread(self, upto_epoch: int) -> List[WorkSlice]:
        """The slices this node has not emitted yet whose epoch is at most ``upto_epoch``
        (the rest of the prefix, then the planned epochs), for an elastic resume."""
        out = [s for s in self.prefix[self._pre - self.prefix_offset:] if s.epoch <= upto_epoch]
        last = upto_epoch if self.epochs is None else min(upto_epoch, self.first_epoch + self.epochs - 1)
        for epoch in range(self._epoch, last + 1):
            plan = self._plan_of(epoch)
            out += plan[self._index:] if epoch == self._epoch else plan
        return out

    def ahead(self) -> Iterator[WorkSlice]:
        """The slices this node will emit from its current position on, in order, without moving
        it: what a reader may fetch ahead (readahead.py). Taken at the call (a later `next` does not
        shift it); epochs are planned as they are reached, so an endless node gives an endless
        iterator. Empty for a round that cannot restart (`next` raises there)."""
        if self._unstartable:
            return iter(())
        return self._ahead_from(self._pre, self._epoch, self._index, self._plan)

    def _ahead_from(self, pre: int, epoch: int, index: int, plan: Optional[List[WorkSlice]]) -> Iterator[WorkSlice]:
        for k in range(pre, self._end):
            yield self.prefix[k - self.prefix_offset]
        while self.epochs is None or epoch < self.first_epoch + self.epochs:
            plan = self._plan_of(epoch) if plan is None else plan
            yield from plan[index:]
            epoch, index, plan = epoch + 1, 0, None

    def next_epoch(self) -> int:
        """The epoch of the next slice this node would emit (its position, in epochs)."""
        if self._pre < self._end:
            return self.prefix[self._pre - self.prefix_offset].epoch
        return self._epoch

    def handed_over_through(self) -> int:
        """The last epoch an elastic resume's plan handed over (its prefix stands for what the
        old shards had left of epochs up to it; planning resumes after it), or -1 without a plan.
        A later elastic resume must carry those epochs on even when none of their rows is left
        in this shard: its next slice may still be of an earlier epoch."""
        return self.start_epoch - 1 if self.resumed else -1

    def next(self) -> WorkSlice:
        if self._unstartable:
            raise RuntimeError("this round continues an elastic resume whose handed-over work is partly used up, "
                               "so it cannot restart from its start (a break, then iter(loader) again); keep one "
                               "iterator, or load the state again")
        if self._pre < self._end:
            self._pre += 1
            return self.prefix[self._pre - 1 - self.prefix_offset]
        while not self._finished():
            if self._plan is None:
                self._plan = self._plan_of(self._epoch)
            if self._index < len(self._plan):
                item = self._plan[self._index]
                self._index += 1
                return item
            self._epoch, self._index, self._plan = self._epoch + 1, 0, None
        raise StopIteration

    def get_state(self) -> Dict[str, Any]:
        return {self.EPOCH: self._epoch, self.INDEX: self._index, self.PREFIX: self._pre}

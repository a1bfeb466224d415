"""In-memory examples (lists of dicts) as sources, and batches of examples.

`ReadList` treats an in-memory sequence like a file of rows: a `ShardUnits`
parent with one unit of ``len(items)`` rows gives each (rank, worker) shard its
contiguous range of a seeded per-epoch permutation, so examples are shuffled per
epoch, disjoint across shards, and the state is a position (the sharder's state
plus rows emitted). Each example comes out as a copy of the dict with
``dataset_name`` and ``dataset_idx`` added.

`Take` ends a stream after ``n`` items (fixed epoch lengths); `BatchExamples`
collates ``batch_size`` examples with ``collate_fn`` (default: strings and other
objects as lists, numbers as tensors, tensors and arrays stacked) and counts,
per dataset, the examples it delivered.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence

import numpy as np
import torch

from ..base import Node
from ..items import DROP_KEY, take
from ..shard import ShardUnits, WorkSlice
from .text_files import UnitCursor


class Example(NamedTuple):
    value: Any
    source: str
    epoch: int


class ReadList(Node[Example]):
    """An in-memory sequence read as one unit of rows: each shard's share of a seeded per-epoch
    permutation, as `Example` s (see the module docstring).

    Args:
        parent: the `ShardUnits` node over one unit of ``len(items)`` rows.
        items: the examples. A mapping comes out as a dict copy with ``dataset_name`` (``source``)
            and ``dataset_idx`` (``index``) added; anything else as it is.
        source: the dataset's name (``dataset_name``, and `Example.source`, which `BatchExamples`
            counts by).
        index: the dataset's index among the loader's datasets (``dataset_idx``).
        seed: seeds the row permutation of each epoch.
        shuffle: False: rows in list order every epoch.

    State keys: ``PARENT`` (the sharder's state at the start of the current slice) and ``ROW``
    (rows of that slice handed out): a position; a restore takes the slice again and skips.
    """

    PARENT = "parent"
    ROW = "row"
    STATE_KEYS = (PARENT, ROW)

    def __init__(self, parent: ShardUnits, items: Sequence[Any], *, source: str, index: int = 0, seed: int = 0,
                 shuffle: bool = True):
        super().__init__(parent)
        self.parent, self.items, self.source, self.index = parent, items, source, index
        self.seed, self.shuffle = seed, shuffle
        self._cursor = UnitCursor(parent, self._load, seed=seed, shuffle_rows=shuffle)

    def _load(self, s: WorkSlice) -> int:
        return len(self.items)  # one unit: the whole list

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        if initial_state is None:
            self._cursor.reset(None, 0)
        else:
            self._cursor.reset(initial_state[self.PARENT], initial_state[self.ROW])

    def next(self) -> Example:
        s, i = self._cursor.next()
        item = self.items[i]
        value = {**item, "dataset_name": self.source, "dataset_idx": self.index} if isinstance(item, Mapping) else item
        return Example(value, self.source, s.epoch)

    def get_state(self) -> Dict[str, Any]:
        parent, row = self._cursor.position()
        return {self.PARENT: parent, self.ROW: row}


class Take(Node[Any]):
    """The first ``n`` items of the parent, then the end.

    Args:
        parent: the node whose items are handed on.
        n: items handed on before the end (``0``: none).

    State keys: ``PARENT`` (the parent's state) and ``COUNT`` (items handed on so far).
    """

    PARENT = "parent"
    COUNT = "count"
    STATE_KEYS = (PARENT, COUNT)

    def __init__(self, parent: Node, n: int):
        super().__init__(parent)
        if n < 0:
            raise ValueError(f"{n=} must be >= 0")
        self.parent, self.n, self._count = parent, n, 0

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])
        self._count = 0 if initial_state is None else int(initial_state[self.COUNT])

    def next(self) -> Any:
        if self._count >= self.n:
            raise StopIteration
        item = next(self.parent)
        self._count += 1
        return item

    def get_state(self) -> Dict[str, Any]:
        return {self.PARENT: self.parent.state_dict(), self.COUNT: self._count}


def default_collate(batch: List[Any]) -> Any:
    """Dicts become dicts of columns: strings (and anything else) stay lists, numbers become
    tensors, tensors and arrays are stacked. This is the multiplex seed's collate."""
    if not batch:
        return batch
    first = batch[0]
    if isinstance(first, Mapping):
        return {k: default_collate([b[k] for b in batch]) for k in first}
    if isinstance(first, torch.Tensor):
        return torch.stack(batch)
    if isinstance(first, np.ndarray):
        return torch.from_numpy(np.stack(batch))
    if isinstance(first, numbers.Number) and all(isinstance(b, numbers.Number) for b in batch):
        return torch.tensor(batch)
    return list(batch)


class BatchExamples(Node[Any]):
    """Batches of ``batch_size`` examples collated by ``collate_fn``, counting per dataset the
    examples delivered (see the module docstring).

    Args:
        parent: a node of `Example` (a `ReadList`, or several mixed).
        batch_size: examples a batch holds (the last one may hold fewer).
        sources: the dataset names, in the order `counts` reports them.
        collate_fn: a list of example values -> the batch (default `default_collate`).
        drop_last: a short last batch is dropped (sent on as a ``DROP_KEY`` marker the loader
            drops, its examples counted as dropped) instead of delivered.

    State keys: ``PARENT`` (the parent's state), ``COUNTS`` (examples delivered so far, by dataset
    name) and ``DROPPED`` (examples of the short batches dropped).
    """

    PARENT = "parent"
    COUNTS = "counts"
    DROPPED = "dropped"
    STATE_KEYS = (PARENT, COUNTS, DROPPED)

    def __init__(self, parent: Node[Example], *, batch_size: int, sources: Sequence[str],
                 collate_fn: Optional[Callable[[List[Any]], Any]] = None, drop_last: bool = False):
        super().__init__(parent)
        if batch_size < 1:
            raise ValueError(f"{batch_size=} must be >= 1")
        self.parent, self.batch_size, self.sources = parent, batch_size, list(sources)
        self.collate_fn, self.drop_last = collate_fn or default_collate, drop_last
        self._counts = dict.fromkeys(self.sources, 0)
        self._dropped = 0

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])
        if initial_state is None:
            self._counts, self._dropped = dict.fromkeys(self.sources, 0), 0
        else:
            self._counts = {k: int(initial_state[self.COUNTS][k]) for k in self.sources}
            self._dropped = int(initial_state[self.DROPPED])

    def next(self) -> Any:
        items: List[Example] = take(self.parent, self.batch_size)
        if self.drop_last and len(items) < self.batch_size:
            self._dropped += len(items)
            # Sent on as a marker so the count reaches the loader; the loader drops it.
            return {DROP_KEY: True}
        for it in items:
            self._counts[it.source] += 1
        return self.collate_fn([it.value for it in items])

    def get_state(self) -> Dict[str, Any]:
        return {self.PARENT: self.parent.state_dict(), self.COUNTS: dict(self._counts), self.DROPPED: self._dropped}

    def counts(self) -> List[int]:
        return [self._counts[s] for s in self.sources] + [self._dropped]

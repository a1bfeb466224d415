"""The statistics counters a loader has handed to the training loop, across workers and rounds.

A graph with a `WithStats` root sends, with every batch, its worker's cumulative counter vector
(one int per key of ``keys``; from a worker, only its changed entries cross, pipes/stats.py).
`Tally` keeps the latest vector per worker and the totals of the
rounds that finished (worker graphs restart their counters each round). Combined over workers a
counter is summed, except those in ``min_keys`` (passes each worker makes over its own shard),
whose figure is the least. The loader saves ``per_worker`` and ``earlier`` in its state's meta
(``STATS``, ``EARLIER``) and restores them.
"""

from __future__ import annotations

import copy
from typing import Dict, Iterable, List, Mapping, Sequence


class Tally:
    """Counters seen by the training loop (module docstring).

    Args:
        keys: the counters' names, in the order the graph sends them.
        min_keys: the keys combined over workers by their least value, not their sum.
    """

    def __init__(self, keys: Sequence[str], min_keys: Sequence[str] = ()):
        self.keys = tuple(keys)
        self._min_at = [i for i, k in enumerate(self.keys) if k in set(min_keys)]
        self.per_worker: Dict[str, List[int]] = {}  # worker -> its latest cumulative vector, this round
        self.earlier: List[int] = [0] * len(self.keys)  # totals of the finished rounds

    def see(self, worker: object, counters: List[int]) -> None:
        self.per_worker[str(worker)] = counters

    def combine(self, vectors: Iterable[List[int]]) -> List[int]:
        """Vectors as one: summed, except the ``min_keys`` (least)."""
        vectors = list(vectors)
        out = [sum(col) for col in zip(*vectors)] if vectors else [0] * len(self.keys)
        for i in self._min_at:
            out[i] = min(v[i] for v in vectors) if vectors else 0
        return out

    def current(self) -> List[int]:
        """This round's counters, over workers."""
        return self.combine(self.per_worker.values())

    def totals(self) -> Dict[str, int]:
        """Every round's counters: the finished rounds' plus this one's."""
        return {k: a + b for k, a, b in zip(self.keys, self.earlier, self.current())}

    def next_round(self) -> None:
        self.earlier = [a + b for a, b in zip(self.earlier, self.current())]
        self.per_worker = {}

    def check(self, per_worker: Mapping[str, List[int]], earlier: List[int]) -> None:
        """Refuse saved counters of another layout (another recipe's, another graph's)."""
        n = len(self.keys)
        bad = {w: len(v) for w, v in per_worker.items() if len(v) != n}
        if bad or len(earlier) != n:
            raise ValueError(f"loader state carries statistics of another layout (counters per worker {bad}, "
                             f"this loader counts {n}: {list(self.keys)}); was it saved by another recipe?")

    def restore(self, per_worker: Mapping[str, List[int]], earlier: List[int]) -> None:
        self.per_worker = copy.deepcopy(dict(per_worker))
        self.earlier = [int(x) for x in earlier]

    def share_of(self, metas_counters: Sequence[tuple], rank: int, world: int, with_current: bool) -> None:
        """An elastic resume: this rank's share of the old ranks' totals, ``(per_worker, earlier)`` each
        (with their current rounds' counters where the round is over), split evenly by rank."""
        summed = [sum(int(e[i]) for _, e in metas_counters) for i in range(len(self.keys))]
        if with_current:
            for per_worker, _ in metas_counters:
                summed = [a + b for a, b in zip(summed, self.combine(per_worker.values()))]
        self.earlier = [t * (rank + 1) // world - t * rank // world for t in summed]
        self.per_worker = {}

"""The dataset a loader worker iterates: it builds its shard's node graph and runs it.

A recipe (or the user) gives a *factory*, a picklable ``factory(ctx: ShardContext) -> node``
that builds the graph of one shard; `NodeDataset` calls it inside each loader worker (or in
the main process with ``num_workers=0``), so only the factory's small arguments cross the
process boundary, and hands torchdata's `StatefulDataLoader` the graph's state with the round
it belongs to. bridge.py's `TokenLoomLoader` runs it.
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

from torch.utils.data import IterableDataset, get_worker_info

from ..base import StateError
from .elastic import CARRY, apply_carry, build_shard, check_elastic
from ..compat.torchdata import WholeState
from .wire import WireBatch, public_batch
from .wire_ring import BatchRing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardContext:
    """Which shard a graph is being built for. ``shard``/``num_shards`` are the
    global shard index and count: ``rank * num_workers + worker`` of
    ``world_size * num_workers`` (a 0-worker loader counts as one worker)."""

    rank: int
    world_size: int
    worker: int
    num_workers: int
    round: int = 0
    #: After an elastic resume, this shard's plan for the round (see elastic.py), else None.
    elastic: Optional[Dict[str, Any]] = None

    @property
    def shard(self) -> int:
        return self.rank * max(self.num_workers, 1) + self.worker

    @property
    def num_shards(self) -> int:
        return self.world_size * max(self.num_workers, 1)


GraphFactory = Callable[[ShardContext], Any]


class NodeDataset(IterableDataset):
    """Builds the node graph of this worker's shard lazily and iterates it.

    The round a new ``iter()`` starts is decided by the training process alone and read
    from a shared memory cell, so persistent workers (which keep this object across
    ``iter()`` calls) start the round the loader asked for. A worker that reached its
    shard's end inside its prefetch once moved itself to the next round, and a peek
    followed by a ``for`` loop then ran the next epoch (issue 14).
    """

    ROUND = "round"
    NODE = "node"

    def __init__(self, factory: GraphFactory, *, rank: int, world_size: int, num_workers: int):
        super().__init__()
        self.factory, self.rank, self.world_size, self.num_workers = factory, rank, world_size, num_workers
        # Passed to the workers when they start (fork or spawn), then shared.
        self._round_cell = multiprocessing.RawValue("q", 0)
        self._elastic: Optional[Dict[str, Any]] = None
        self._sources: Optional[List[str]] = None
        self._root = None
        self._root_round: Optional[int] = None
        self._active_round = 0
        self._failed: Optional[Exception] = None
        self._deferred: Optional[int] = None  # in a worker: the round iter() asked for, not started yet
        # One shared-memory ring per worker (wire_ring.py), made before the workers fork.
        self.rings: Optional[List[BatchRing]] = None
        # Set by tokenloom's loader when it starts iterating (forks, or takes batches in-process):
        # only then do batches carry the statistics key and use the rings. A DataLoader a framework
        # re-creates around this dataset (workers forked later, or in-process before tokenloom's
        # loader ran) gets the public batch dicts and sends through the pipe.
        self.armed = False

    @property
    def round(self) -> int:
        """The round the next ``iter()`` starts (written by the training process only)."""
        return int(self._round_cell.value)

    @round.setter
    def round(self, value: int) -> None:
        self._round_cell.value = int(value)

    @property
    def elastic(self) -> Optional[Dict[str, Any]]:
        """After an elastic resume: ``{"round": r, "shards": {worker: plan}}`` for this rank."""
        return self._elastic

    @elastic.setter
    def elastic(self, value: Optional[Dict[str, Any]]) -> None:
        self._elastic, self._root = value, None  # graphs are built with their plan

    def source_names(self) -> List[str]:
        """The sources of the graph, in its order, once it is known to continue on another topology
        (`elastic.check_elastic`: ValueError naming the node that cannot). Built once, in this process."""
        if self._sources is None:
            self._sources = check_elastic(self.factory(ShardContext(self.rank, self.world_size, 0, self.num_workers,
                                                                    self.round)))
        return self._sources

    def _context(self, round_: int) -> ShardContext:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        if info is not None and info.num_workers != self.num_workers:
            raise RuntimeError(f"loader runs {info.num_workers} workers but the dataset was built for "
                               f"num_workers={self.num_workers}; build it through tokenloom's loader")
        plan = None
        if self._elastic is not None and int(self._elastic["round"]) == round_:
            plan = self._elastic["shards"][str(worker)]
        return ShardContext(self.rank, self.world_size, worker, self.num_workers, round_, plan)

    def own_first_fetches(self) -> List[Any]:
        """The first fetches this loader's factory started in this process (``factory.first_fetches()``,
        if it has one; first_fetches.py): the fork of its workers waits for them, their bytes then come
        with the workers' memory."""
        own = getattr(self.factory, "first_fetches", None)
        return list(own()) if own is not None else []

    def fetch_first(self, trees: Mapping[int, Any]) -> None:
        """After a restore, before the workers start: let the factory fetch what each worker reads first
        from where ``trees`` (worker -> its saved ``{"round", "node"}``; missing: none) put it, if it
        can (``factory.fetch_first``, e.g. a remote source's first row groups; only an early start: a
        failure here is logged, the workers fetch their own)."""
        fetch = getattr(self.factory, "fetch_first", None)
        if fetch is None:
            return
        round_ = self.round
        shards = []
        for w in range(max(self.num_workers, 1)):
            plan = None
            if self._elastic is not None and int(self._elastic["round"]) == round_:
                plan = self._elastic["shards"][str(w)]
            saved = trees.get(w) or {}
            node = saved.get(self.NODE) if int(saved.get(self.ROUND, round_)) == round_ else None
            shards.append((ShardContext(self.rank, self.world_size, w, self.num_workers, round_, plan), node))
        try:
            fetch(shards)
        except Exception:  # noqa: BLE001
            log.debug("no first fetches for the restored positions", exc_info=True)

    def _start(self, round_: int, node_state: Optional[Dict[str, Any]]) -> None:
        self._failed = None
        try:
            ctx = self._context(round_)
            if self._root is None or self._root_round != round_:
                self._root = build_shard(self.factory, ctx)
                self._root_round = round_
            self._root.reset(node_state)
            if node_state is None and ctx.elastic is not None:
                apply_carry(self._root, ctx.elastic[CARRY])
        except Exception as e:
            if get_worker_info() is None:
                raise
            # Raised here, in a worker's startup, the error would surface while the loader
            # builds its iterator, where tokenloom cannot reach the workers to stop them; at
            # the first batch it passes through StatsIterator (iteration.py), which does.
            self._failed = e
        self._active_round = round_

    def __iter__(self) -> "NodeDataset":
        if get_worker_info() is None:
            self._start(self.round, None)
        else:
            # torchdata's worker calls iter() and then, to resume, loads the state: the graph starts at the
            # first batch or state asked of it instead, so it is not reset twice (a reset starts a remote
            # source's fetches, which the second would drop).
            self._deferred = self.round
        return self

    def _begin(self) -> None:
        if self._deferred is not None:
            round_, self._deferred = self._deferred, None
            self._start(round_, None)

    def __next__(self):
        self._begin()
        if self._failed is not None:
            _raise_portable(self._failed)
        batch = None
        while batch is None:
            try:
                batch = next(self._root)
            except StopIteration:
                raise
            except Exception as e:
                _raise_portable(e)
            if not self.armed:
                batch = public_batch(batch)  # None: a dropped-batch report, for tokenloom's loader only
        # Numpy crosses the process boundary ~5x cheaper than tensors, shared memory cheaper
        # still (see wire.py, wire_ring.py); it arrives as the batch dict.
        info = get_worker_info()
        if info is None:
            return batch
        return WireBatch(batch, self.rings[info.id] if self.rings and self.armed else None)

    def state_dict(self) -> Dict[str, Any]:
        self._begin()
        # A graph that failed to build has no position (its error comes with the first batch).
        node = None if self._failed is not None else self._root.state_dict()
        if get_worker_info() is not None:
            node = WholeState(node)  # one leaf for torchdata's per-step delta (snapshot.py)
        return {self.ROUND: self._active_round, self.NODE: node}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != {self.ROUND, self.NODE}:
            raise StateError(f"worker state has keys {sorted(state) if isinstance(state, Mapping) else state!r}, "
                             f"expected {[self.ROUND, self.NODE]}; was it saved by a tokenloom loader?")
        self._deferred = None
        self._start(int(state[self.ROUND]), state[self.NODE])


def _raise_portable(e: Exception) -> None:
    """Re-raise ``e``; in a worker, as a `RuntimeError` with its type and message when its
    class cannot be pickled. The DataLoader sends an error's class to the main process by
    reference; one defined inside a function fails to pickle, and the training loop would
    see a dead worker instead of the error (or, where the message goes through a queue's
    feeder thread, wait forever for a batch that never comes)."""
    if get_worker_info() is not None:
        try:
            pickle.dumps(type(e))
        except Exception:
            raise RuntimeError(f"{type(e).__module__}.{type(e).__qualname__}: {e}") from e
    raise e

"""torchdata's internals, used here and nowhere else: worker snapshots kept flat, and the hook
where a loader's iterator (and its workers) is made.

Flat snapshots. `StatefulDataLoader` (snapshot every step, which tokenloom needs: any batch may be
the one a checkpoint resumes after) applies each worker's state delta to a flat ``{key path:
leaf}`` dict, then rebuilds every worker's nested state dict at every step (`_update_snapshot`),
though a state is asked for once in thousands of steps. `keep_snapshots_flat` replaces that step
on one iterator: it keeps a shallow copy of each worker's flat dicts (leaves are never changed in
place, a delta replaces them) and `nested_snapshot` builds the same nested dicts when the
loader's ``state_dict()`` runs. It relies on ``_update_snapshot`` and the
``_IncrementalWorkerState`` fields; `flat_snapshots_ok` checks them on first use (else
torchdata's own rebuild stays), and tests/test_wire.py compares the states it gives with
torchdata's own at every step. What the rebuild costs: docs/performance.md.

The main state. With each index it sends, the iterator records its own state
(``_get_main_state``), asking ``isinstance(obj, Stateful)`` of its sampler and the sampler's
iterator: a runtime-checkable protocol, which Python 3.11 checks attribute by attribute at every
call. `keep_snapshots_flat` also gives the iterator the same dict with that question asked once
per object (`_StatefulOnce`), installed only if it equals torchdata's own on that iterator.

A worker also hands torchdata its graph's state as one leaf (`WholeState`), not a nested dict:
torchdata flattens every worker state into ``{key path: leaf}`` and compares it with the previous
one at every step, in the worker, to send only what changed. Whole, it is one dict comparison.
The leaf itself crosses to the training process as a patch of the state the worker sent before
(pipes/state_delta.py): with many sources a step changes a few of them. `nested_snapshot` gives
the plain dicts back.

The end snapshot. With ``snapshot_every_n_steps=N`` torchdata snapshots at the N-th steps only;
`snapshot_at_end` takes one more when the iterator's data ends (each worker's final state is in by
then), so a state taken after the end, or while a rank pads, has no steps since its snapshot. It uses
``_update_snapshot``, ``_get_main_state`` and the iterator's counters; where they differ
(`end_snapshot_ok`) it does nothing, and such a state resumes on the same topology only
(tests/test_sparse_snapshots.py forces it).

The iterator. `IteratorHook` runs a loader's ``start_iterator`` around
``StatefulDataLoader._get_iterator``, where a new iterator forks its workers;
`current_iterator` and `stop_workers` read and reset ``_iterator`` and call the iterator's
``_shutdown_workers``; `keep_for_shutdown` keeps what that shutdown uses alive until the iterator is
freed (the collector would finalize it first); `batches_ready` reads its queues and early batches (``loader.figures()``). Fallback where torchdata differs (`iterator_hook_ok` False): the loader
calls ``start_iterator`` around its whole ``iter()`` and sends batches through the pipe (no
shared-memory ring, whose rings must be made for each new set of workers), and stopped workers
are left to the garbage collector (tests/test_compat.py forces it).
"""

from __future__ import annotations

import functools
import inspect
import itertools
import weakref
from typing import Any, Callable, Dict, Mapping, NamedTuple, Optional

from torch.utils.data import get_worker_info
from torchdata.stateful_dataloader.incremental_state import (
    _DATASET_ITER_STATE,
    _DATASET_STATE,
    _FETCHER_ENDED,
    _FETCHER_STATE,
    _WORKER_ID,
    _IncrementalWorkerState,
    _unflatten,
)
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.stateful import Stateful
from torchdata.stateful_dataloader.stateful_dataloader import (
    _INDEX_SAMPLER_STATE,
    _ITERABLEDATASET_LEN_CALLED,
    _SAMPLER_ITER_STATE,
    _SAMPLER_ITER_YIELDED,
    _SHARED_SEED,
    _StatefulMultiProcessingDataLoaderIter,
)

from ..state_delta import receive, sender


class WholeState:
    """A worker graph's state as one leaf of torchdata's incremental delta (see the module
    docstring). Equal when the states are equal, so an unchanged state is not sent again."""

    __slots__ = ("state",)

    def __init__(self, state: Any):
        self.state = state

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, WholeState) and self.state == other.state

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        if get_worker_info() is None:
            return WholeState, (self.state,)
        # From a worker, only through its result queue, which the training process reads in order.
        return _whole_from_patch, sender().send(self.state)


def _whole_from_patch(stream: str, number: int, change: tuple) -> WholeState:
    return WholeState(receive(stream, number, change))


def plain(obj: Any) -> Any:
    """``obj`` with every `WholeState` in its dicts and lists replaced by the state it holds."""
    if isinstance(obj, WholeState):
        return obj.state
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    return obj


class _FlatWorker(NamedTuple):
    """One worker's state at a snapshot, as the flat dicts torchdata keeps."""

    worker_id: Any
    fetcher_ended: Optional[bool]
    dataset: Dict[tuple, Any]
    iterator: Dict[tuple, Any]

    def nested(self) -> Dict[str, Any]:
        # What _IncrementalWorkerState.get_state() returns.
        fetcher = None if self.fetcher_ended is None else {
            _FETCHER_ENDED: self.fetcher_ended, _DATASET_ITER_STATE: _unflatten(self.iterator)}
        return {_WORKER_ID: self.worker_id, _DATASET_STATE: _unflatten(self.dataset), _FETCHER_STATE: fetcher}


class _FlatWorkers(dict):
    """``{worker key: _FlatWorker}``, standing where torchdata puts the nested worker states."""


def _update_snapshot_flat(self, snapshot_step, last_yielded_worker_id, num_workers, main_snapshot, worker_snapshots):
    self._snapshot = {
        self._SNAPSHOT_STEP: snapshot_step,
        self._LAST_YIELDED_WORKER_ID: last_yielded_worker_id,
        self._MAIN_SNAPSHOT: main_snapshot,
        self._WORKER_SNAPSHOTS: _FlatWorkers(
            (key, _FlatWorker(w._worker_id, w._fetcher_ended, dict(w._incr_dataset_state.flat_state),
                              dict(w._incr_fetcher_iter_state.flat_state)))
            for key, w in worker_snapshots.items()),
    }


@functools.lru_cache(maxsize=None)
def flat_snapshots_ok() -> bool:
    """`_internals_as_expected`, asked once."""
    return _internals_as_expected()


def _internals_as_expected() -> bool:
    """Whether this torchdata has the internals `_update_snapshot_flat` relies on; if not, its
    own per-step rebuild stays (slower, never wrong)."""
    it, w = _StatefulMultiProcessingDataLoaderIter, _IncrementalWorkerState(None)
    try:
        params = list(inspect.signature(it._update_snapshot).parameters)
    except (AttributeError, TypeError, ValueError):
        return False
    return (params == ["self", "snapshot_step", "last_yielded_worker_id", "num_workers", "main_snapshot",
                       "worker_snapshots"]
            and all(hasattr(it, a) for a in ("_SNAPSHOT", "_SNAPSHOT_STEP", "_LAST_YIELDED_WORKER_ID",
                                              "_MAIN_SNAPSHOT", "_WORKER_SNAPSHOTS"))
            and all(hasattr(w, a) for a in ("_worker_id", "_fetcher_ended"))
            and all(hasattr(getattr(w, a, None), "flat_state") for a in ("_incr_dataset_state",
                                                                        "_incr_fetcher_iter_state")))


def keep_snapshots_flat(it: Any) -> Any:
    """Make a multi-worker iterator keep its snapshots flat, and take its main state without asking
    at every step whether its sampler is `Stateful` (see the module docstring)."""
    if flat_snapshots_ok() and isinstance(it, _StatefulMultiProcessingDataLoaderIter):
        # Through a weak proxy: a bound method stored on the iterator would be a reference
        # cycle, leaving the iterator (and its workers' shutdown) to the garbage collector, which
        # makes deleting a loader with persistent workers wait for the workers' exit timeouts.
        proxy = weakref.proxy(it)
        it._update_snapshot = functools.partial(_update_snapshot_flat, proxy)
        main_state = functools.partial(_main_state, proxy, _StatefulOnce())
        if main_state() == type(it)._get_main_state(it):  # what torchdata's own gives, else its own stays
            it._get_main_state = main_state
    return it


def snapshot_at_end(it: Any) -> None:
    """After a multi-worker iterator ended (raised StopIteration), record its snapshot at that step.

    With ``snapshot_every_n_steps=N`` torchdata snapshots at the N-th steps only, so when the data ends
    between two of them (a finite round; a rank that pads until the others' data ends) every later
    ``state_dict()`` would be steps after its snapshot, which an elastic resume refuses though nothing
    remains to replay. Every worker has sent its final state with its end, and torchdata has applied it:
    the snapshot taken here holds each worker's last position, at the number of batches yielded. Where a
    snapshot was taken at the last step (N=1, the default, or an end on an N-th step) nothing changes.
    Where this torchdata lacks what it uses (`end_snapshot_ok`, or an attribute), nothing is done: such a
    state is then refused elastically, as before, and resumes on the same topology."""
    if not (isinstance(it, _StatefulMultiProcessingDataLoaderIter) and end_snapshot_ok()):
        return
    try:
        interval, snapshot, yielded = it._snapshot_interval, it._snapshot, it._num_yielded
        last, workers, states = it._last_yielded_worker_id, it._num_workers, it._worker_snapshots
    except AttributeError:
        return
    if not interval or not snapshot or snapshot[it._SNAPSHOT_STEP] == yielded:
        return
    it._update_snapshot(yielded, last, workers, it._get_main_state(), states)


def end_snapshot_ok() -> bool:
    """Whether this torchdata's multi-worker iterator takes a snapshot as `snapshot_at_end` calls it: the
    ``_update_snapshot`` that `flat_snapshots_ok` checks, and ``_get_main_state``."""
    return flat_snapshots_ok() and hasattr(_StatefulMultiProcessingDataLoaderIter, "_get_main_state")


class _StatefulOnce:
    """``isinstance(obj, Stateful)``, asked once per object: ``Stateful`` is a runtime-checkable
    protocol, which Python 3.11 checks attribute by attribute on every call, and torchdata
    asks it of the sampler and its iterator at every step."""

    __slots__ = ("_seen",)

    def __init__(self):
        self._seen: Dict[str, tuple] = {}

    def state(self, name: str, obj: Any) -> Any:
        seen = self._seen.get(name)
        if seen is None or seen[0] is not obj:
            seen = self._seen[name] = (obj, isinstance(obj, Stateful))
        return obj.state_dict() if seen[1] else None


def _main_state(self, once: _StatefulOnce) -> Dict[str, Any]:
    # torchdata 0.11's _get_main_state with try_to_serialize's check made once per object;
    # keep_snapshots_flat installs it only where it gives what torchdata's own gives.
    return {
        self._NUM_WORKERS: self._num_workers,
        _SAMPLER_ITER_STATE: once.state("sampler_iter", self._sampler_iter),
        _INDEX_SAMPLER_STATE: once.state("index_sampler", self._index_sampler),
        _SAMPLER_ITER_YIELDED: self._sampler_iter_yielded,
        _ITERABLEDATASET_LEN_CALLED: self._IterableDataset_len_called,
        _SHARED_SEED: self._shared_seed,
        self._BASE_SEED: self._base_seed,
    }


def nested_snapshot(inner: Dict[str, Any]) -> Dict[str, Any]:
    """``inner`` (a StatefulDataLoader state) with its worker snapshots nested, as torchdata
    builds them, and the workers' graph states plain dicts (a copy)."""
    snap = inner.get(_StatefulMultiProcessingDataLoaderIter._SNAPSHOT)
    key = _StatefulMultiProcessingDataLoaderIter._WORKER_SNAPSHOTS
    workers = snap.get(key) if isinstance(snap, dict) else None
    if isinstance(workers, _FlatWorkers):
        inner = dict(inner)
        inner[_StatefulMultiProcessingDataLoaderIter._SNAPSHOT] = dict(snap, **{key: {k: w.nested() for k, w in
                                                                                      workers.items()}})
    return plain(inner)


# --- the loader's iterator ------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def iterator_hook_ok() -> bool:
    """Whether this torchdata makes every iterator in ``StatefulDataLoader._get_iterator`` and keeps
    it in ``_iterator``, as `IteratorHook` expects (torchdata 0.11)."""
    get = getattr(StatefulDataLoader, "_get_iterator", None)
    code = getattr(StatefulDataLoader.__iter__, "__code__", None)
    return get is not None and code is not None and {"_get_iterator", "_iterator"} <= set(code.co_names)


class IteratorHook:
    """Mixin for a `StatefulDataLoader`: ``start_iterator(make)`` runs around the making of each new
    iterator, which is where its workers are forked. Fallback, where torchdata makes iterators
    otherwise (`iterator_hook_ok` False): ``__iter__`` of the loader calls `start_iterator` around
    the whole ``iter()`` itself (`hooked`)."""

    def start_iterator(self, make: Callable[[], Any]) -> Any:
        raise NotImplementedError

    def _get_iterator(self):
        if not iterator_hook_ok():
            return super()._get_iterator()  # type: ignore[misc]
        return self.start_iterator(super()._get_iterator)  # type: ignore[misc]

    @staticmethod
    def hooked() -> bool:
        """Whether new iterators go through `start_iterator` by themselves."""
        return iterator_hook_ok()


def current_iterator(loader: Any) -> Optional[Any]:
    """The iterator the loader would continue (None: not started, or forgotten)."""
    return getattr(loader, "_iterator", None)


def batches_ready(it: Any) -> Optional[int]:
    """Batches the workers have finished that the loop has not taken yet: the messages waiting in
    the iterator's result queues (``qsize``: the worker result queue and, with ``pin_memory``, the
    pinning thread's) and the batches that arrived before their turn (kept in ``_task_info`` beside
    their index). None where that cannot be read: no workers, a queue without ``qsize`` (macOS), or
    an iterator that keeps other fields (tests/test_figures.py forces it)."""
    try:
        info, received = it._task_info, it._rcvd_idx
        queues = {id(q): q for q in (it._worker_result_queue, it._data_queue)}
        early = sum(1 for i, task in list(info.items()) if i >= received and len(task) == 2)
        return early + sum(q.qsize() for q in queues.values())
    except (AttributeError, NotImplementedError, TypeError):
        return None


#: What a multi-process iterator's ``_shutdown_workers`` uses (torch's and torchdata's iterators).
SHUTDOWN_PARTS = ("_workers", "_index_queues", "_worker_result_queue", "_data_queue", "_workers_done_event",
                  "_pin_memory_thread", "_pin_memory_thread_done_event")
_kept_for_shutdown: Dict[int, tuple] = {}
_kept_keys = itertools.count()


def keep_for_shutdown(it: Any) -> Any:
    """Keep what ``it``'s shutdown uses (`SHUTDOWN_PARTS`: its queues, worker processes, events)
    alive until ``it`` is freed, so that its ``__del__`` stops its workers with them intact; returns ``it``.

    Why: an iterator that is only reachable through a reference cycle (a loader in a trainer's
    objects, a traceback) is freed by the garbage collector together with its queues and worker
    processes, and the collector finalizes those in any order. A queue's `Connection` then closes its
    pipe without forgetting the descriptor's number, and a worker's ``Popen`` closes its sentinel;
    the iterator's ``__del__`` runs after, puts the workers' exit message into that queue (a feeder
    thread starts and, once the queue is closed, closes the stale number again) and waits on the
    stale sentinel. The number may belong by then to another file: a pipe a new loader is forking its
    workers with (a Lightning job that ran three fits in one process failed so, ``EBADF`` in
    multiprocessing's fork), or the pipe of another iterator's queue. Kept reachable from here, the
    parts are not in the collector's batch of garbage: a weak reference's callback lets go of them
    first (the collector calls those before any ``__del__``), the iterator's ``__del__`` shuts the
    workers down the normal way, and the parts are freed after it. An iterator freed by its reference
    count runs its ``__del__`` before its weak references' callbacks: the same order.

    Fallback: an iterator without ``_shutdown_workers`` or any of these parts (another torchdata), or
    without weak references, is left to the collector as it was (tests/test_compat.py forces it)."""
    parts = tuple(getattr(it, name) for name in SHUTDOWN_PARTS if hasattr(it, name))
    if not parts or getattr(it, "_shutdown_workers", None) is None:
        return it
    key = next(_kept_keys)
    try:
        weakref.finalize(it, _kept_for_shutdown.pop, key, None).atexit = False
    except TypeError:  # no weak references to it: nothing would let go of the parts
        return it
    _kept_for_shutdown[key] = parts
    return it


def kept_for_shutdown() -> int:
    """How many iterators have their shutdown's parts kept (tests)."""
    return len(_kept_for_shutdown)


def stop_workers(loader: Any, it: Any) -> None:
    """Stop ``it``'s workers now, and make the loader start fresh ones at its next iter()
    (persistent workers too). Fallback: left to the garbage collector."""
    shutdown = getattr(it, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
        if getattr(loader, "_iterator", None) is it:
            loader._iterator = None


# --- the loader state's layout ---------------------------------------------------------------
# StatefulDataLoader's state dict is torchdata's own format (its iterators' _SNAPSHOT constants);
# the readers below are the one place that knows it.

def worker_dataset_states(loader_state: Mapping[str, Any]) -> Dict[int, Any]:
    """``{worker: its dataset state}`` in a StatefulDataLoader state (0 workers: the main process's
    fetcher holds the one dataset state, as worker 0)."""
    snapshot = loader_state.get(_StatefulMultiProcessingDataLoaderIter._SNAPSHOT)
    if snapshot is None:
        return {0: _dataset_state(loader_state)}
    workers = snapshot[_StatefulMultiProcessingDataLoaderIter._WORKER_SNAPSHOTS]
    return {int(w[_WORKER_ID]): _dataset_state(w) for w in workers.values()}


def worker_trees_ended(loader_state: Mapping[str, Any]) -> Dict[int, bool]:
    """``{worker: whether its data had ended}`` at the last snapshot of a multi-worker
    StatefulDataLoader state (empty for 0 workers)."""
    snapshot = loader_state.get(_StatefulMultiProcessingDataLoaderIter._SNAPSHOT)
    if snapshot is None:
        return {}
    workers = snapshot[_StatefulMultiProcessingDataLoaderIter._WORKER_SNAPSHOTS]
    return {int(w[_WORKER_ID]): bool((w.get(_FETCHER_STATE) or {}).get(_FETCHER_ENDED)) for w in workers.values()}


def _dataset_state(holder: Mapping[str, Any]) -> Any:
    fetcher = holder.get(_FETCHER_STATE) or {}
    return fetcher.get(_DATASET_ITER_STATE) or holder.get(_DATASET_STATE)


def last_yielded_worker(loader_state: Mapping[str, Any]) -> Optional[int]:
    """The worker the last batch came from (None: 0 workers, or not started)."""
    snapshot = loader_state.get(_StatefulMultiProcessingDataLoaderIter._SNAPSHOT)
    if snapshot is None:
        return None
    return int(snapshot[_StatefulMultiProcessingDataLoaderIter._LAST_YIELDED_WORKER_ID])


def steps_since_snapshot(loader_state: Mapping[str, Any]) -> int:
    """Batches yielded after the last worker snapshot (``snapshot_every_n_steps > 1``)."""
    return int(loader_state.get(_StatefulMultiProcessingDataLoaderIter._STEPS_SINCE_SNAPSHOT) or 0)

"""Worker snapshots kept flat until a state is asked for.

`StatefulDataLoader` (snapshot every step, which tokenloom needs: any batch may be the
one a checkpoint resumes after) applies each worker's state delta to a flat
``{key path: leaf}`` dict, then rebuilds every worker's nested state dict at every
step (`_update_snapshot`), though a state is asked for once in thousands of steps.
With the token cache that rebuild is ~32 us per worker per batch: ~17% of the
training process's own work per batch, with 2 workers.

`keep_snapshots_flat` replaces that step on one iterator: it keeps a shallow copy of
each worker's flat dicts (~0.2 us; leaves are never changed in place, a delta
replaces them) and `nested_snapshot` builds the same nested dicts when the loader's
``state_dict()`` runs. It touches torchdata internals (`_update_snapshot`, the
`_IncrementalWorkerState` fields): torchdata is pinned to 0.11, the module checks
at import that they are as expected (else torchdata's own rebuild stays), and
tests/test_wire.py compares the states it gives with torchdata's own at every step.

A worker also hands torchdata its graph's state as one leaf (`WholeState`), not a nested
dict: torchdata flattens every worker state into ``{key path: leaf}`` and compares it with
the previous one at every step, in the worker, to send only what changed. For a two-source
pretrain graph (41 leaves) that was ~30 us a batch, 3% of a worker's batch from the token
cache, to drop the few leaves that did not move. Whole, it is one dict comparison, and a
message ~300 bytes longer. `nested_snapshot` gives the plain dicts back.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Dict, NamedTuple, Optional

from torchdata.stateful_dataloader.incremental_state import (
    _DATASET_ITER_STATE,
    _DATASET_STATE,
    _FETCHER_ENDED,
    _FETCHER_STATE,
    _WORKER_ID,
    _IncrementalWorkerState,
    _unflatten,
)
from torchdata.stateful_dataloader.stateful_dataloader import _StatefulMultiProcessingDataLoaderIter


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
        return WholeState, (self.state,)


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


_EXPECTED = _internals_as_expected()


def keep_snapshots_flat(it: Any) -> Any:
    """Make a multi-worker iterator keep its snapshots flat (see the module docstring)."""
    if _EXPECTED and isinstance(it, _StatefulMultiProcessingDataLoaderIter):
        # Through a weak proxy: a bound method stored on the iterator would be a reference
        # cycle, leaving the iterator (and its workers' shutdown) to the garbage collector:
        # deleting a loader with persistent workers then took 10 s instead of 0.1 s.
        it._update_snapshot = functools.partial(_update_snapshot_flat, weakref.proxy(it))
    return it


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

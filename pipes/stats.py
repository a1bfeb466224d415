"""Carry a worker's cumulative statistics inside each batch it produces.

The loader's main process sees batches in exactly the order the training loop
does, so statistics counted there are "what the loop has seen", with no extra
channel between processes. Each batch carries its worker's *cumulative* counters
under `STATS_KEY` (pickled with the batch's envelope rather than sent as a tensor
through the ring); the loader keeps the latest vector per worker and sums them.
Every batch reaches the loader's ``see`` in order, the dropped ones included
(pipes/loader/iteration.py).

The vector has a few counters per source (tokens, documents, ...), so with many sources
it is long while a batch changes the few entries of the sources it drew from: from a
worker, a batch's `Counters` cross as the entries changed since the vector the worker
sent before (the first whole), numbered, so the loader refuses a patch out of turn rather
than sum wrong counters.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
from torch.utils.data import get_worker_info

from .base import Node
from .state_delta import Receiving, Sending, sending
from .items import STATS_KEY
from .roles import PASS


class Counters:
    """A worker's cumulative counters, as a batch carries them (``worker``, ``values``: ints).

    Pickled in a loader worker (only through its result queue, which the training process reads
    in order, the batches torchdata fast-forwards on a resume included) it crosses as the entries
    changed since the vector the worker sent before; the training process rebuilds the vector
    (`_received_counters`) and refuses a patch out of turn."""

    __slots__ = ("worker", "values")

    def __init__(self, worker: int, values: Any):
        self.worker, self.values = worker, values

    def as_list(self) -> List[int]:
        return self.values.tolist() if isinstance(self.values, np.ndarray) else list(self.values)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Counters) and self.worker == other.worker and self.as_list() == other.as_list()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Counters(worker={self.worker}, values={self.as_list()})"

    def __reduce__(self):
        if get_worker_info() is None:
            return Counters, (self.worker, self.as_list())
        return _received_counters, (self.worker, *_sending().send(np.asarray(self.values, np.int64)))


def _vector_patch(last: Any, values: np.ndarray, first: bool) -> tuple:
    """``(at, values)`` of the entries changed since ``last`` (``at`` None: the whole vector)."""
    if first or last.shape != values.shape:
        return None, values.tolist()
    at = np.flatnonzero(values != last)
    return at.tolist(), values[at].tolist()


def _sending() -> Sending:
    return sending("counters", _vector_patch)


_received = Receiving(lambda number, stream, got: (
    f"statistics patch number {number} of stream {stream} came after {got}: a batch's statistics did not reach "
    "the loader in order, so its counters cannot be rebuilt. Please report it with the loader settings"))


def _received_counters(worker: int, stream: str, number: int, change: tuple) -> Counters:
    at, values = change

    def rebuild(last: Any) -> np.ndarray:
        if at is None:
            return np.asarray(values, np.int64)
        vector = last.copy()
        vector[at] = values
        return vector

    try:
        return Counters(worker, _received.receive(stream, number, rebuild))
    except RuntimeError as e:
        raise RuntimeError(f"worker {worker}'s {e}") from None


class WithStats(Node[Dict[str, Any]]):
    """Adds ``batch[STATS_KEY] = Counters(worker, counters())`` (module docstring); ``counters``
    returns ints (a list or an int array) in the order of ``keys`` (the loader sums them per key
    over workers).

    Args:
        parent: a node of batch dicts (a `Batch`).
        counters: called once a batch; returns the worker's cumulative counters, one int per key.
        keys: the counters' names, in the order ``counters`` returns them.
        worker: this worker's number, the first element of the tuple, so the loader keeps the
            latest counters per worker.

    State keys: ``PARENT`` (the parent's state; the counters are cumulative and belong to the
    nodes that count them, so nothing of them is saved here).
    """

    ROLE = PASS
    PARENT = "parent"
    STATE_KEYS = (PARENT,)

    def __init__(self, parent: Node, *, counters: Callable[[], Sequence[int]], keys: Sequence[str], worker: int):
        super().__init__(parent)
        self.parent, self.counters, self.keys, self.worker = parent, counters, tuple(keys), worker

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])

    def next(self) -> Dict[str, Any]:
        batch = next(self.parent)
        values = np.asarray(self.counters(), dtype=np.int64)
        if values.shape != (len(self.keys),):
            raise RuntimeError(f"WithStats: counters() gave {values.size} values for {len(self.keys)} keys")
        batch[STATS_KEY] = Counters(self.worker, values)
        return batch

    def get_state(self) -> Dict[str, Any]:
        return {self.PARENT: self.parent.state_dict()}


def format_stats(stats: Dict[str, Any]) -> str:
    """A plain-text table of `loader.stats()` for logs: packing figures, then per source
    tokens, documents, epochs, target share and observed share."""
    lines = []
    tokens_in, out, pad = stats.get("tokens_in", 0), stats.get("tokens_out", 0), stats.get("padding", 0)
    if tokens_in or out:
        lines.append(f"packing: {out:,} tokens in rows, padding {100 * pad / max(out + pad, 1):.3f}%, "
                     f"discarded {100 * stats.get('discarded', 0) / max(tokens_in, 1):.3f}%, "
                     f"{stats.get('documents', 0):,} documents, {stats.get('chunked', 0):,} cut")
    sources = stats.get("sources") or {}
    if sources:
        lines.append(f"{'source':<16}{'tokens':>14}{'documents':>12}{'epochs':>8}{'target':>9}{'share':>9}{'diff':>8}")
        for name, s in sources.items():
            diff = 100 * (s["share"] - s["target"])
            lines.append(f"{name:<16}{s['tokens']:>14,}{s['documents']:>12,}{s['epochs']:>8}"
                         f"{100 * s['target']:>8.2f}%{100 * s['share']:>8.2f}%{diff:>+7.2f}")
        ahead = {n: s["readahead"] for n, s in sources.items() if (s.get("readahead") or {}).get("peak_bytes")}
        if ahead:
            lines.append("read-ahead: " + ", ".join(f"{n} {a['bytes'] / 2**20:.1f} MiB held ({a['peak_bytes'] / 2**20:.1f} "
                                                    "peak)" for n, a in ahead.items()))
    return "\n".join(lines)

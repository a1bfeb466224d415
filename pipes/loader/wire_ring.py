"""A batch's arrays through shared memory: one worker writes, the training process copies out.

Through the result queue a batch's bytes are copied five times: narrowed to int32,
pickled, written into the pipe (a pipe buffer at a time, the writer waiting for the reader),
read out of it, and widened back to int64. Here the worker writes each array once,
narrowing as it goes (an int64 array whose values all fit int32, checked as it is
copied: ``_narrowcore.c``, or numpy's min and max where it is not built), into a ring
of shared memory made by the training process before it forks the worker, and the
queue carries only where the arrays are; the
training process widens them out of the ring (the copy it made anyway) and frees the
space. That lowers the CPU per batch of both the training process and the workers
(measured by `benchmarks/throughput.py`; see docs/performance.md).

The ring is a byte ring per worker with two counters in its first bytes: ``head``
(bytes written, advanced by the worker) and ``tail`` (bytes freed, advanced by the
training process). Both only grow. A worker's batches reach the training process in
the order it sent them (one queue; tokenloom refuses ``in_order=False``, and torch
decodes every message it drains, including at a persistent worker's reset), so the
space before a decoded batch's end is free. A batch that does not fit, or a worker
whose ring is unusable (a start method that pickles the dataset: ``spawn``,
``forkserver``), travels through the pipe as before: never a wait, never a
deadlock, only the slower path.

Trade-off: the ring is sized for the batches a worker may have ready
(``prefetch_factor`` + 2 of them): about what those batches took in the worker's
queue, so its memory grows with the batch shape and ``prefetch_factor``.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from typing import Any, List, Optional, Tuple

import numpy as np

try:
    from . import _narrowcore  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler: numpy's min, max and copy
    _narrowcore = None

_HEADER = 64  # head, tail (int64), then padding to a cache line
_ALIGN = 64
_I32 = np.iinfo(np.int32)

# Rings made by this (training) process, by token: a decoded batch names its ring. Weak: the
# loader's dataset holds its rings, and a ring goes when a new iterator replaces it.
_RINGS: "weakref.WeakValueDictionary[str, BatchRing]" = weakref.WeakValueDictionary()
_counter = itertools.count()
_lock = threading.Lock()


class BatchRing:
    """One worker's shared ring; made in the training process before the workers fork."""

    def __init__(self, capacity: int):
        if capacity < _ALIGN:
            raise ValueError(f"{capacity=} must be >= {_ALIGN} bytes")
        self.capacity = int(capacity) // _ALIGN * _ALIGN
        self.token = f"{os.getpid()}-{next(_counter)}"
        self._mm: Optional[mmap.mmap] = mmap.mmap(-1, _HEADER + self.capacity)  # MAP_SHARED: a fork shares it
        self._ctrl = np.frombuffer(self._mm, np.int64, 2)  # [head, tail]
        with _lock:
            _RINGS[self.token] = self

    def __getstate__(self):
        # A start method that pickles the dataset cannot share an anonymous mapping: the worker
        # gets a ring it will not use (its batches go through the pipe).
        return {"capacity": self.capacity, "token": self.token, "_mm": None, "_ctrl": None}

    @property
    def usable(self) -> bool:
        return self._mm is not None

    # --- the worker's side --------------------------------------------------------
    def put(self, arrays: List[Tuple[np.ndarray, Optional[bool]]]) -> Optional[Tuple[int, int, List[int], List[bool]]]:
        """Write ``arrays``, ``(array, narrow)``: narrow True writes an int64 array as int32 (its
        values known to fit), None narrows an int64 array if every value fits (checked as it is
        copied), False writes it as it is. Returns ``(start, end, offsets, narrowed)`` or None
        when they do not fit now."""
        narrowed = [bool(n) if n is not None else _may_narrow(a) for a, n in arrays]
        while True:
            sizes = []
            for (a, _), narrow in zip(arrays, narrowed):
                n = a.size * (4 if narrow else a.itemsize)
                sizes.append(-(-n // _ALIGN) * _ALIGN)
            need = sum(sizes)
            head, tail = int(self._ctrl[0]), int(self._ctrl[1])
            pos = head % self.capacity
            skip = self.capacity - pos if pos + need > self.capacity else 0  # never split a batch at the wrap
            if need == 0 or head + skip + need - tail > self.capacity:
                return None
            start = head + skip
            offsets, at, wide_after_all = [], start % self.capacity, None
            for i, ((a, given), narrow, size) in enumerate(zip(arrays, narrowed, sizes)):
                dst = np.ndarray(a.shape, np.int32 if narrow else a.dtype, buffer=self._mm, offset=_HEADER + at)
                if not narrow:
                    np.copyto(dst, a, casting="no")
                elif given:
                    np.copyto(dst, a, casting="unsafe")  # values checked to fit int32 by the caller
                elif not _narrow_into(a, dst):
                    wide_after_all = i
                    break
                offsets.append(at)
                at += size
            if wide_after_all is None:
                break
            narrowed[wide_after_all] = False  # a value past int32: lay the batch out again, that array wide
        self._ctrl[0] = start + need  # after the data: the reader looks only once the message arrives
        return start, start + need, offsets, narrowed

    # --- the training process's side ---------------------------------------------
    def take(self, offset: int, dtype: str, shape: Tuple[int, ...], widen: bool) -> np.ndarray:
        src = np.ndarray(shape, np.dtype(dtype), buffer=self._mm, offset=_HEADER + offset)
        return src.astype(np.int64) if widen else src.copy()

    def free_to(self, end: int) -> None:
        if end > int(self._ctrl[1]):
            self._ctrl[1] = end


def ring_of(token: str) -> Optional[BatchRing]:
    return _RINGS.get(token)


def make_rings(workers: int, capacity: int) -> List[BatchRing]:
    return [BatchRing(capacity) for _ in range(workers)]


def _may_narrow(a: np.ndarray) -> bool:
    return a.dtype == np.int64 and a.size > 0


def _narrow_into(a: np.ndarray, dst: np.ndarray) -> bool:
    """Copy int64 ``a`` into int32 ``dst`` if every value fits (one pass in C where built)."""
    if _narrowcore is not None and a.flags.c_contiguous:
        return _narrowcore.narrow(a, dst)
    if not narrowable(a):
        return False
    np.copyto(dst, a, casting="unsafe")
    return True


def narrowable(a: np.ndarray) -> bool:
    """An int64 array whose values fit in int32 (token ids, labels, positions)."""
    return _may_narrow(a) and _I32.min <= a.min() and a.max() <= _I32.max


def uses_fork(context: Any) -> bool:
    """Whether workers started with ``context`` (the DataLoader's ``multiprocessing_context``:
    None, a start method's name or a context) inherit this process's memory."""
    import multiprocessing

    if context is None:  # torch then uses the multiprocessing module's default
        method = multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
    else:
        method = context if isinstance(context, str) else context.get_start_method()
    return method == "fork"

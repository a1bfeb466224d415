"""How a batch crosses from a loader worker to the training process: as numpy arrays.

A worker's batch reaches the main process through a multiprocessing queue. A
`torch.Tensor` goes through torch's shared-memory reducer: a fresh shared
segment per tensor, its file descriptor passed over a Unix socket, mapped again
on the other side. That costs about the same whatever the size, and a batch has
seven tensors. A numpy array is pickled into the pipe instead: one copy of its
bytes. Measured on 2 cores, one batch from 2 workers (`benchmarks/throughput.py`,
``ipc``): B=8, T=2048 (512 KB): 3.2 ms as tensors, 0.7 ms as numpy; B=2, T=63
(4 KB): 3.5 ms vs 0.26 ms. The main process pays that per batch, in ``next()``.

So a worker sends `WireBatch` (the batch with every CPU tensor viewed as numpy,
no copy), and the main process turns it back into the same tensors
(``torch.from_numpy``, no copy): dtypes, shapes and values are bitwise the same.
An int64 array whose values fit in int32 (token ids, labels, positions) travels
as int32 and is widened on arrival: a B=8, T=2048 batch is 328 KB on the wire
instead of 524 KB, and the workers' ready batches (up to ~1M tokens each) hold
that much less memory, for a min/max and a copy per array on each side.
With ``pin_memory=True`` the loader's pin-memory thread calls
`WireBatch.pin_memory`, so pinning stays off the training thread.

Trade-off: a batch larger than a few MB would be cheaper through shared memory
(a pipe copy is ~1 GB/s here); token batches are 0.1-2 MB. Tensors numpy cannot
hold (bfloat16) and anything that is not a tensor travel unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


_I32 = np.iinfo(np.int32)


def _to_numpy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu" or obj.requires_grad or obj.dtype == torch.bfloat16:
            return obj
        a = obj.numpy()
        if a.dtype == np.int64 and a.size and _I32.min <= a.min() and a.max() <= _I32.max:
            return _Array(a.astype(np.int32), wide=True)
        return _Array(a)
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_numpy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_numpy(v) for v in obj)
    return obj


def _to_torch(obj: Any, pin: bool) -> Any:
    if isinstance(obj, _Array):
        # numpy's astype, not torch's .to(): profiled in the training process with 2 workers,
        # ~10 us a call against 0.18 ms
        t = torch.from_numpy(obj.array.astype(np.int64) if obj.wide else obj.array)
        return t.pin_memory() if pin else t
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory() if pin else obj
    if isinstance(obj, dict):
        return {k: _to_torch(v, pin) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_torch(v, pin) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):  # a namedtuple travelled as it was
        return tuple(_to_torch(v, pin) for v in obj)
    return obj


class _Array:
    """Marks an array that was a tensor (a user's batch may hold numpy arrays of its own,
    which must stay numpy)."""

    __slots__ = ("array", "wide")

    def __init__(self, array: np.ndarray, wide: bool = False):
        self.array, self.wide = array, wide  # wide: int64 sent as int32

    def __reduce__(self):
        return _Array, (self.array, self.wide)


class WireBatch:
    """A batch in transit; `tensors` (or `pin_memory`) gives back the batch the graph built."""

    __slots__ = ("payload",)

    def __init__(self, batch: Any):
        self.payload = _to_numpy(batch)

    def __reduce__(self):
        return _from_payload, (self.payload,)

    def tensors(self) -> Any:
        return _to_torch(self.payload, pin=False)

    def pin_memory(self, device: Any = None) -> Any:
        # Called by the DataLoader's pin-memory thread (torch checks for a pin_memory method
        # before anything else), so the main thread receives pinned tensors.
        return _to_torch(self.payload, pin=True)


def _from_payload(payload: Any) -> WireBatch:
    w = WireBatch.__new__(WireBatch)
    w.payload = payload
    return w


def unwrap(batch: Any) -> Any:
    """The batch as the graph built it, whether or not it came through a worker."""
    return batch.tensors() if isinstance(batch, WireBatch) else batch

"""How a batch crosses from a loader worker to the training process: as numpy arrays.

A worker's batch reaches the main process through a multiprocessing queue. A
`torch.Tensor` goes through torch's shared-memory reducer: a fresh shared
segment per tensor, its file descriptor passed over a Unix socket, mapped again
on the other side. That costs about the same whatever the size, and a batch has
seven tensors. A numpy array is pickled into the pipe instead: one copy of its
bytes, cheaper than the tensors' reducer at every batch size tokenloom makes
(measured by `benchmarks/throughput.py`, ``ipc``). The main process pays that per
batch, in ``next()``.

So a worker sends `WireBatch` (the batch with every CPU tensor viewed as numpy,
no copy), and the main process turns it back into the same tensors
(``torch.from_numpy``, no copy): dtypes, shapes and values are bitwise the same.
An int64 array whose values fit in int32 (token ids, labels, positions) travels
as int32 and is widened on arrival: a batch's int64 arrays take half the bytes on
the wire, and the workers' ready batches hold that much less memory, for a check and a
copy per array on each side (into the ring, the check is made as the array is copied:
one pass, `wire_ring`'s ``_narrowcore.c``).
With ``pin_memory=True`` the DataLoader's pin-memory thread pins the batch dict as it
arrives, so pinning stays off the training thread.

Where the workers were forked, the arrays skip the pipe: each worker writes them
into a shared-memory ring and the queue carries only their places
(`wire_ring`); the pipe is the fallback for whatever does not fit.

What arrives (is unpickled) is the batch dict itself, never a wire object. So a DataLoader
other than tokenloom's, one a framework re-creates around ``loader.dataset`` (Accelerate, a
trainer's own StatefulDataLoader subclass), gets the batch dicts tokenloom's loader yields; its
workers (not forked by tokenloom's loader, see `NodeDataset.armed`) leave out the statistics
key, which only tokenloom's loader reads and removes.

Trade-off: a batch much larger than token batches are would be cheaper through shared
memory than through a pipe copy. Tensors numpy cannot hold (bfloat16) and anything that
is not a tensor travel unchanged.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np
import torch

from ..items import DROP_KEY, STATS_KEY  # noqa: F401 (the keys a graph's batches carry; re-exported)
from . import wire_ring


#: Marks a batch whose arrays were in shared memory a newer iterator replaced (raised where the
#: loop takes it, not inside the queue's get).
STALE_KEY = "_tokenloom_stale"


def public_batch(batch: Any) -> Any:
    """A graph's batch for a DataLoader other than tokenloom's: without the statistics key (None
    for a dropped-batch report, which only tokenloom's loader reads)."""
    if not isinstance(batch, dict) or (STATS_KEY not in batch and DROP_KEY not in batch):
        return batch
    if DROP_KEY in batch:
        return None
    return {k: v for k, v in batch.items() if k != STATS_KEY}


def _is_plain_tensor(v: Any) -> bool:
    """A tensor numpy can view as it is: on the CPU, no autograd, not bfloat16."""
    return isinstance(v, torch.Tensor) and v.device.type == "cpu" and not v.requires_grad and v.dtype != torch.bfloat16


def _to_numpy(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        if not _is_plain_tensor(obj):
            return obj
        a = obj.numpy()
        return _Array(a, wide=wire_ring.narrowable(a))
    if isinstance(obj, dict):
        return {k: _to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_numpy(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_numpy(v) for v in obj)
    return obj


def _arrays(obj: Any, out: List["_Array"]) -> List["_Array"]:
    if isinstance(obj, _Array):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _arrays(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _arrays(v, out)
    return out


def _to_torch(obj: Any, pin: bool) -> Any:
    if isinstance(obj, _Array):
        if obj.array is None:
            raise _Stale(STALE_MESSAGE)
        t = torch.from_numpy(obj.array)
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
    which must stay numpy). In the worker: the tensor's array, ``wide`` if it is int64 with
    values that fit int32 (it travels narrowed), ``place`` where it was written in the ring
    (None: through the pipe). Arrived: the array as the tensor had it."""

    __slots__ = ("array", "wide", "place")

    def __init__(self, array: Optional[np.ndarray], wide: bool = False):
        self.array, self.wide, self.place = array, wide, None

    def __reduce__(self):
        a = self.array
        if self.place is not None:
            token, offset = self.place
            return _from_ring, (token, offset, np.dtype(np.int32 if self.wide else a.dtype).str, a.shape, self.wide)
        # numpy's astype, not torch's .to(): profiled in the training process with 2 workers,
        # ~10 us a call against 0.18 ms
        return _from_pipe, (a.astype(np.int32) if self.wide else a, self.wide)


def _from_pipe(array: np.ndarray, wide: bool) -> _Array:
    return _Array(array.astype(np.int64) if wide else array)


def _from_ring(token: str, offset: int, dtype: str, shape: Tuple[int, ...], wide: bool) -> _Array:
    ring = wire_ring.ring_of(token)
    return _Array(None if ring is None else ring.take(offset, dtype, shape, wide))


def _placed_dict(batch: dict, ring: wire_ring.BatchRing) -> Optional[tuple]:
    """A dict batch whose tensors all fit the ring now, as one entry per key in order:
    ``(key, place, value)``, place ``(offset, dtype, shape, narrowed)`` for a tensor written to the
    ring (value None), None for any other value (sent as `_to_numpy` makes it). None: they do not fit."""
    arrays, keys = [], []
    for k, v in batch.items():
        if _is_plain_tensor(v):
            arrays.append((v.numpy(), None))  # int64 narrowed where its values fit, checked as it is copied
            keys.append(k)
    placed = ring.put(arrays) if arrays else None
    if placed is None:
        return None
    _, end, offsets, narrowed = placed
    where = {k: (off, np.dtype(np.int32 if wide else a.dtype).str, a.shape, wide)
             for k, (a, _), off, wide in zip(keys, arrays, offsets, narrowed)}
    entries = tuple((k, where[k], None) if k in where else (k, None, _to_numpy(v)) for k, v in batch.items())
    return ring.token, end, entries


def _from_placed_dict(token: str, end: int, entries: tuple) -> Any:
    """The batch of `_placed_dict`, its tensors copied out of the ring, which is then freed up to ``end``."""
    ring = wire_ring.ring_of(token)
    if ring is None:  # the ring of an iterator a newer one replaced (see _from_payload)
        return {STALE_KEY: True}
    out = {}
    for key, place, value in entries:
        if place is None:
            out[key] = _to_torch(value, False)
        else:
            offset, dtype, shape, wide = place
            out[key] = torch.from_numpy(ring.take(offset, dtype, shape, wide))
    ring.free_to(end)
    return out


class WireBatch:
    """A batch in transit from a worker; it arrives (is unpickled) as the batch the graph built.
    Made with the worker's `wire_ring.BatchRing`, the arrays go through shared memory where
    they fit.

    A dict batch whose tensors all fit (the graphs' batches) travels as one call that
    rebuilds the dict (`_placed_dict`): no per-array object on either side, the ring looked up
    once. Anything else travels as `_to_numpy` makes it, each array placed in the ring where
    it fits."""

    __slots__ = ("payload", "_freed_to", "_placed")

    def __init__(self, batch: Any, ring: Optional[wire_ring.BatchRing] = None):
        self._freed_to: Optional[Tuple[str, int]] = None
        self._placed: Optional[tuple] = None
        if ring is not None and ring.usable and type(batch) is dict:
            self._placed = _placed_dict(batch, ring)
            if self._placed is not None:
                self.payload = batch
                self._freed_to = (ring.token, self._placed[1])
                return
        self.payload = _to_numpy(batch)
        if ring is not None and ring.usable:
            arrays = _arrays(self.payload, [])
            placed = ring.put([(x.array, x.wide) for x in arrays]) if arrays else None
            if placed is not None:
                _, end, offsets, _ = placed
                for x, off in zip(arrays, offsets):
                    x.place = (ring.token, off)
                self._freed_to = (ring.token, end)

    def __reduce__(self):
        if self._placed is not None:
            return _from_placed_dict, self._placed
        return _from_payload, (self.payload, self._freed_to)

    def tensors(self) -> Any:
        """The batch as it arrives, without crossing a process (tests)."""
        if self._placed is not None:
            return dict(self.payload)
        return _from_payload(self.payload, None)


def _from_payload(payload: Any, freed_to: Optional[Tuple[str, int]] = None) -> Any:
    # Unpickled after its arrays (pickle builds the arguments first): they are copied out,
    # so the ring's space up to this batch's end is free.
    if freed_to is not None:
        ring = wire_ring.ring_of(freed_to[0])
        if ring is not None:
            ring.free_to(freed_to[1])
    try:
        return _to_torch(payload, pin=False)
    except _Stale:
        # Raised where the loop takes the batch (bridge.py), not here, inside the queue's get.
        return {STALE_KEY: True}


class _Stale(RuntimeError):
    pass


STALE_MESSAGE = ("a batch sent by a worker of an earlier iterator arrived after a new iter(loader) replaced its "
                 "shared memory; use the iterator returned by the latest iter(loader)")


def unwrap(batch: Any) -> Any:
    """The batch as the graph built it, whether or not it came through a worker."""
    return batch.tensors() if isinstance(batch, WireBatch) else batch

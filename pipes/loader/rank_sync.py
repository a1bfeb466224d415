"""Equal batch counts across ranks in a finite epoch, without dropping or repeating data.

Ranks own disjoint documents, and documents differ in length, so after packing
one rank may have a few batches more than another. A distributed trainer whose
ranks take different numbers of steps hangs in its next collective. Making the
counts equal by construction would need every rank to know every other rank's
token counts up front (a full tokenizing pass); dropping the excess loses data;
repeating documents breaks disjointness.

So ranks agree as they go: after fetching its next batch (or finding its stream
ended), each rank contributes one bit, "I still have data", to a MAX all-reduce
of one int over a CPU (gloo) group. If no rank has data the epoch ends on every
rank at the same step; a rank that ran out early yields padding batches (all
``labels`` -100, ``segment_ids`` 0) until the others finish. The cost is one
tiny all-reduce per step on finite epochs only; endless streams never communicate.

A training loop should normalise its loss by the number of target tokens
summed across ranks (not a per-rank mean), so a padding batch contributes
nothing instead of a 0/0.
"""

from __future__ import annotations

import threading
from typing import Optional, Protocol


class RankSync(Protocol):
    def any_true(self, flag: bool) -> bool:
        """True if ``flag`` is true on at least one rank; every rank must call it in step."""


class TorchDistSync:
    """`RankSync` over a torch.distributed process group (gloo, CPU tensors)."""

    def __init__(self, group=None):
        self.group = group

    def any_true(self, flag: bool) -> bool:
        import torch
        import torch.distributed as dist

        t = torch.tensor([1 if flag else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())


def gloo_sync_from_dist() -> Optional[TorchDistSync]:
    """A `TorchDistSync` on a gloo group of its own when torch.distributed is initialized
    (the flag lives on the CPU); None otherwise. A group of its own, even when the default
    backend is gloo: the loader may agree from a prefetch thread while the training loop
    runs collectives on the default group, and two threads must never interleave calls on
    one group. Every rank must call this at the same point, as with any group creation."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    return TorchDistSync(dist.new_group(backend="gloo"))


class ThreadSync:
    """`RankSync` for ranks simulated as threads in one process (tests, notebooks)."""

    def __init__(self, world_size: int):
        self._barrier = threading.Barrier(world_size)
        self._lock = threading.Lock()
        self._round = [False, False]
        self._parity = threading.local()

    def any_true(self, flag: bool) -> bool:
        p = getattr(self._parity, "p", 0)
        self._parity.p = 1 - p
        with self._lock:
            self._round[p] = self._round[p] or flag
        self._barrier.wait()
        result = self._round[p]
        self._barrier.wait()
        # Everyone has read slot p; nobody writes it again before all have passed the next
        # step's first wait, so clearing it here cannot erase a flag.
        with self._lock:
            self._round[p] = False
        return result

    def abort(self) -> None:
        """Release every rank waiting in `any_true` with `threading.BrokenBarrierError`: a rank that
        failed calls it, so the others fail too instead of waiting for it for ever."""
        self._barrier.abort()

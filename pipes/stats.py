"""Carry a worker's cumulative statistics inside each batch it produces.

The loader's main process sees batches in exactly the order the training loop
does, so statistics counted there are "what the loop has seen", with no extra
channel between processes. Each batch carries its worker's *cumulative* counters
(a few int64s under `STATS_KEY`); the loader keeps the latest vector per worker
and sums them. Cumulative counters make this robust to the batches the loader
skips internally while resuming: the next batch a worker delivers brings the
right totals.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from .base import Node
from .loader import STATS_KEY


class WithStats(Node[Dict[str, Any]]):
    """Adds ``batch[STATS_KEY] = [worker, *counters]`` using ``counters()`` (a callable
    returning a dict with ``keys``)."""

    PARENT = "parent"
    STATE_KEYS = (PARENT,)

    def __init__(self, parent: Node, *, counters: Callable[[], Dict[str, int]], keys: Sequence[str], worker: int):
        super().__init__()
        self.parent, self.counters, self.keys, self.worker = parent, counters, tuple(keys), worker

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self.parent.reset(None if initial_state is None else initial_state[self.PARENT])

    def next(self) -> Dict[str, Any]:
        batch = next(self.parent)
        c = self.counters()
        batch[STATS_KEY] = torch.tensor([self.worker, *(int(c[k]) for k in self.keys)], dtype=torch.int64)
        return batch

    def get_state(self) -> Dict[str, Any]:
        return {self.PARENT: self.parent.state_dict()}

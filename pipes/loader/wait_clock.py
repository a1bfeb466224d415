"""How long the training loop waits for its data: the figure that says whether the loader is the
bottleneck.

Each ``next()`` on a loader's iterator is timed from the call to the batch in hand (the *wait*: a
fetch from the workers' queues, or with ``num_workers=0`` the making of the batch), and the time
between a batch in hand and the next call is the loop's own *step* (forward, backward, optimizer,
logging). Over the last `WINDOW` steps, the mean and p99 wait and the share of the loop's time spent
waiting, ``sum(wait) / (sum(wait) + sum(step))``; in total, the wait of every batch. The first batch
of an iterator (worker start-up, the first fetches) is kept apart (``first_batch_s``): it would
swamp the window's mean and is not a step's wait. A loop that breaks and makes a new iterator starts
no step across the gap.

Invariants: one `enter` then one `leave` per batch handed out, in the loop's thread; a ``next()`` that
raises (the round's end, an error) counts nothing. Cost: two ``perf_counter`` calls and two appends
per batch.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Deque, Dict, Optional

#: Steps the window figures cover.
WINDOW = 100


class WaitClock:
    """The training loop's waits on one loader (module docstring)."""

    def __init__(self, window: int = WINDOW):
        self._waits: Deque[float] = deque(maxlen=window)
        self._steps: Deque[float] = deque(maxlen=window)
        self._out: Optional[float] = None  # when the last batch was handed out (None: a new iterator)
        self.total_wait_s = 0.0
        self.batches = 0
        self.first_batch_s: Optional[float] = None

    def new_iterator(self) -> None:
        """A new iterator starts: its first batch is a first batch, and no step spans the gap."""
        self._out = None

    def enter(self) -> float:
        return time.perf_counter()

    def leave(self, entered: float) -> None:
        """A batch is in hand (``entered``: what `enter` returned for this ``next()``)."""
        now = time.perf_counter()
        wait = now - entered
        self.total_wait_s += wait
        self.batches += 1
        if self._out is None:
            self.first_batch_s = wait
        else:
            self._steps.append(entered - self._out)
            self._waits.append(wait)
        self._out = now

    def figures(self) -> Dict[str, float]:
        """``wait_ms``, ``wait_p99_ms`` and ``wait_share`` over the window (0 before a second batch),
        ``wait_total_s``, ``first_batch_s``."""
        waits = sorted(self._waits)
        busy = sum(self._steps) + sum(waits)
        return {
            "wait_ms": 1e3 * sum(waits) / len(waits) if waits else 0.0,
            "wait_p99_ms": 1e3 * waits[min(len(waits) - 1, int(0.99 * len(waits)))] if waits else 0.0,
            "wait_share": sum(waits) / busy if busy > 0 else 0.0,
            "wait_total_s": self.total_wait_s,
            "first_batch_s": self.first_batch_s or 0.0,
        }

"""An in-memory sequence as a source node: items ``[0, n)`` in order, optionally cycled.

State is the index of the next item and the pass number, so a restore is O(1).
Used for in-memory datasets (the ``multiplex`` recipe) and for tests.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from ..base import Node


class FromList(Node[Any]):
    """Items ``[0, n)`` of an in-memory sequence, in order, optionally cycled (see the module docstring).

    Args:
        items: the sequence.
        passes: passes over it before the end (default 1); None cycles forever (``items`` must not
            be empty).

    State keys: ``INDEX`` (the index of the next item in the current pass; ``len(items)`` at a
    pass's end) and ``PASS`` (the current pass, from 0): a restore is O(1).
    """

    INDEX = "index"
    PASS = "pass"
    STATE_KEYS = (INDEX, PASS)

    def __init__(self, items: Sequence[Any], *, passes: Optional[int] = 1):
        super().__init__()
        if passes is not None and passes < 1:
            raise ValueError(f"{passes=} must be None (cycle forever) or >= 1")
        if passes is None and len(items) == 0:
            raise ValueError("cannot cycle forever over an empty list")
        self.items, self.passes = items, passes
        self._i = self._pass = 0

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        if initial_state is None:
            self._i = self._pass = 0
        else:
            self._i, self._pass = int(initial_state[self.INDEX]), int(initial_state[self.PASS])

    def next(self) -> Any:
        if self._i >= len(self.items):
            self._i, self._pass = 0, self._pass + 1
        if self.passes is not None and self._pass >= self.passes:
            raise StopIteration
        item = self.items[self._i]
        self._i += 1
        return item

    def get_state(self) -> Dict[str, Any]:
        return {self.INDEX: self._i, self.PASS: self._pass}

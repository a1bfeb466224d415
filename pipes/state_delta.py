"""A graph's state sent from a worker as what changed since the state it sent before.

Why: `StatefulDataLoader` takes a worker's state with every batch (any batch may be the one a
checkpoint resumes after) and pickles it to the training process. A graph's state is a tree that
mirrors the graph (pipes/base.py): with ``n`` sources it holds ``n`` branch states, ``n`` save
point entries, ``n`` counts of each kind, so sending it whole costs ``O(n)`` bytes and unpickling
at every step, though a batch moves only the few sources it drew from. Sent as a patch of the
state sent before, a step costs bytes for what moved (measured by benchmarks/sources.py).

The patch of ``old`` to ``new`` (`diff`):

- ``(SAME,)``: nothing changed;
- ``(PUT, new)``: replaced (a leaf, a list that changed much, a dict whose keys changed);
- ``(KEYS, {key: patch})``: a dict with the same keys in the same order, the changed ones patched;
- ``(ITEMS, indices, values)``: a long list of the same length, a few items replaced;
- ``(AT, {index: patch})``: a list of the same length whose changed items are lists or dicts,
  each patched (a long list most of whose items changed is replaced whole).

`patch` applies it, building new containers only along the changed paths: the unchanged parts of
the result are the previous state's own objects (states are never modified in place, neither in
the worker nor in the training process). A subtree that is the very object sent before (a
mixer's cached branch states, a save point's cached entries) costs one identity check.

`Sending` (in a worker) and `Receiving` (in the training process) number a stream's patches, so a
patch that arrives out of turn is refused with an error instead of giving a wrong state.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from itertools import compress
from operator import is_not
from typing import Any, Callable, Dict, Tuple

SAME, PUT, KEYS, ITEMS, AT = 0, 1, 2, 3, 4
#: Lists shorter than this are replaced whole when they change: a patch of its items saves nothing.
LIST_PATCH_MIN = 16
#: Streams the training process keeps the last state of (a new set of workers starts new streams).
STREAMS_KEPT = 1024

_NO_CHANGE = (SAME,)


def diff(old: Any, new: Any) -> tuple:
    """The patch that turns ``old`` into ``new`` (module docstring)."""
    if new is old:
        return _NO_CHANGE
    if type(new) is dict and type(old) is dict:
        if len(new) != len(old) or list(new) != list(old):
            return (PUT, new)
        changed = {}
        # The values that are not the very objects sent before, found in one C loop: most are.
        for k in compress(new, map(is_not, new.values(), old.values())):
            v, o = new[k], old[k]
            if type(v) is dict and type(o) is dict:
                # no equality test first: a nested dict that is not the one sent before has mostly
                # changed, and comparing it whole at every level of the patch costs more than the patch
                change = diff(o, v)
                if change is not _NO_CHANGE:
                    changed[k] = change
            elif v != o:
                changed[k] = diff(o, v)
        return (KEYS, changed) if changed else _NO_CHANGE
    if type(new) is list and type(old) is list and len(new) == len(old):
        if new == old:
            return _NO_CHANGE
        at = [i for i in compress(range(len(new)), map(is_not, old, new)) if old[i] != new[i]]
        few = len(new) < LIST_PATCH_MIN or 2 * len(at) < len(new)
        if few and any(type(new[i]) in (dict, list) for i in at):
            return (AT, {i: diff(old[i], new[i]) for i in at})
        if len(new) >= LIST_PATCH_MIN and 2 * len(at) < len(new):
            return (ITEMS, at, [new[i] for i in at])
        return (PUT, new)
    if type(new) is type(old) and new == old:
        return _NO_CHANGE
    return (PUT, new)


def patch(old: Any, change: tuple) -> Any:
    """``old`` with ``change`` (a `diff`) applied; unchanged parts are ``old``'s own objects."""
    kind = change[0]
    if kind == SAME:
        return old
    if kind == PUT:
        return change[1]
    if kind == KEYS:
        out = dict(old)
        for k, sub in change[1].items():
            out[k] = patch(old[k], sub)
        return out
    if kind == ITEMS:
        out = list(old)
        for i, v in zip(change[1], change[2]):
            out[i] = v
        return out
    if kind == AT:
        out = list(old)
        for i, sub in change[1].items():
            out[i] = patch(old[i], sub)
        return out
    raise ValueError(f"state patch: unknown kind {kind!r}; the worker and the training process run different "
                     "tokenloom versions")


class Sending:
    """One process's numbered stream of values, each sent as ``make(last, value, first)``: the value
    sent before, the new one, and whether it is the stream's first (sent whole). Pickling may run on a
    queue's feeder thread: one stream, one order, under a lock."""

    def __init__(self, make: Callable[[Any, Any, bool], Any]) -> None:
        self.stream = f"{os.getpid()}-{os.urandom(6).hex()}"
        self.make = make
        self._number = -1
        self._last: Any = None
        self._lock = threading.Lock()

    def send(self, value: Any) -> Tuple[str, int, Any]:
        """``(stream, number, what make gave)``."""
        with self._lock:
            self._number += 1
            last, self._last = self._last, value
            return self.stream, self._number, self.make(last, value, self._number == 0)


_sendings: Dict[str, Sending] = {}


def sending(kind: str, make: Callable[[Any, Any, bool], Any]) -> Sending:
    """This process's `Sending` of ``kind`` (made in the process that sends: a forked worker makes its own)."""
    found = _sendings.get(kind)
    if found is None or not found.stream.startswith(f"{os.getpid()}-"):
        found = _sendings[kind] = Sending(make)
    return found


class Receiving:
    """The training process's last value of each stream of one kind, rebuilt patch by patch in order;
    at most `STREAMS_KEPT` streams (a new set of workers starts new ones). ``gap(number, stream, got)``
    is the message of the error a patch out of turn raises."""

    def __init__(self, gap: Callable[[int, str, str], str]) -> None:
        self.gap = gap
        self._last: "OrderedDict[str, Tuple[int, Any]]" = OrderedDict()
        self._lock = threading.Lock()

    def receive(self, stream: str, number: int, rebuild: Callable[[Any], Any]) -> Any:
        """The value of patch ``number`` of ``stream``: ``rebuild(the stream's value before)`` (None for
        the first, which is whole)."""
        with self._lock:
            if number == 0:
                value = rebuild(None)
            else:
                last = self._last.get(stream)
                if last is None or last[0] != number - 1:
                    raise RuntimeError(self.gap(number, stream, "none" if last is None else f"number {last[0]}"))
                value = rebuild(last[1])
            self._last[stream] = (number, value)
            self._last.move_to_end(stream)
            while len(self._last) > STREAMS_KEPT:
                self._last.popitem(last=False)
            return value

    def forget(self) -> Dict[str, int]:
        """Drop the kept values; returns the last number of each stream."""
        with self._lock:
            out = {s: n for s, (n, _) in self._last.items()}
            self._last.clear()
            return out


def _state_patch(last: Any, state: Any, first: bool) -> tuple:
    return (PUT, state) if first else diff(last, state)


def sender() -> Sending:
    """This process's stream of graph states."""
    return sending("state", _state_patch)


_states = Receiving(lambda number, stream, got: (
    f"a loader worker's state patch number {number} of stream {stream} arrived after {got}: a state message was "
    "lost or reordered between the worker and the training process, so this state cannot be rebuilt. Please "
    "report it with the loader settings"))


def receive(stream: str, number: int, change: tuple) -> Any:
    """The state a worker sent as patch ``number`` of ``stream`` (in the training process)."""
    return _states.receive(stream, number, lambda last: patch(last, change))


def forget_streams() -> Dict[str, int]:
    """Drop the kept states (tests); returns how many there were, by stream."""
    return _states.forget()

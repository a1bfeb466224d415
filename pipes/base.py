"""The node protocol every tokenloom node follows, enforced in one place.

A node is a `torchdata.nodes.BaseNode`. A subclass fills three methods:

- ``reset(initial_state)``: go to the start (``None``) or to a saved position;
  setup is lazy, so ``reset`` must stay cheap (no reads, no tokenizing);
- ``next()``: return the next item or raise ``StopIteration``;
- ``get_state()``: return a small dict of plain values whose keys are exactly
  the class constant ``STATE_KEYS``.

A node's state is a function of the calls it received: it changes only in ``reset`` and
``next``, never by itself (a background thread may fetch ahead, but the position it saves
moves only when an item is handed out). And a state, once returned, is never changed in
place, by the node or by whoever holds it. So a node with many parents may keep each
parent's last state and take again only those it pulled since (a mixer of hundreds of
sources does, pipes/mix.py), and states taken one after the other may share their unchanged
parts (a worker sends only what changed, pipes/state_delta.py).

`Node` wraps the subclass's ``reset`` and ``get_state`` (in ``__init_subclass__``)
so that every node checks the same things the same way: a state passed to
``reset`` must carry exactly ``STATE_KEYS`` (a state from another node, another
version or another pipeline is refused with a message naming the node and the
keys; only the keys of the class constant ``KEYS_ADDED``, added in a later loader
state version, may be missing from a state saved before them), and ``get_state``
must return exactly those keys at every step. A parent
node's state always sits under one key of its child's state, so a pipeline's
state is a tree that mirrors the graph.

The check costs one set comparison per state call, nothing per item, which is noise
next to the tokenizing a batch takes.

A node's ``reset`` resets its parents, so inside a graph a parent is always set up
before it is pulled: the per-document loops (tokenizer, mixer, best-fit packer, and the
batcher per row) call ``parent.next()`` and skip `BaseNode.__next__`'s lazy-setup check,
which would otherwise run on every call, three calls a document.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Mapping, Optional, Tuple, TypeVar

from torchdata.nodes import BaseNode

from .roles import OTHER

T = TypeVar("T")


class StateError(ValueError):
    """A saved state does not fit the node it is being loaded into."""


def _describe(node: object) -> str:
    return type(node).__name__


def check_state_keys(node: object, state: Mapping[str, Any], keys: Tuple[str, ...],
                     added: Tuple[str, ...] = ()) -> None:
    """Raise `StateError` unless ``state`` has exactly ``keys``, less any of ``added`` (keys added later)."""
    if not isinstance(state, Mapping):
        raise StateError(
            f"{_describe(node)}: a saved state must be a dict, got {type(state).__name__}; "
            "pass the value returned by state_dict() unchanged"
        )
    got = set(state)
    want = set(keys)
    if got != want and not (got < want and want - got <= set(added)):
        missing = sorted(want - got)
        extra = sorted(got - want)
        raise StateError(
            f"{_describe(node)}: saved state does not match this node ({missing=}, {extra=}). "
            "The state was saved by a different pipeline or tokenloom version; "
            "rebuild the loader with the settings it was saved with, or start without a state."
        )


class Node(BaseNode[T]):
    """Base class of tokenloom nodes: see the module docstring for the contract.

    ``Node.__init__(*parents)``: the nodes this one pulls from, in order (none for a source); they
    are the graph's edges (`parents`, walked by pipes/graph.py). ``ROLE`` (pipes/roles.py) says what
    the node is to the walkers; a node of the user's that declares none is walked through."""

    #: The keys of this node's state; subclasses must declare them.
    STATE_KEYS: Tuple[str, ...] = ()
    #: Keys of ``STATE_KEYS`` added in a later loader state version: a state saved before them may lack them.
    KEYS_ADDED: Tuple[str, ...] = ()
    #: What this node is in a graph (pipes/roles.py): a reader, a branch, a packer, ...
    ROLE: str = OTHER

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "reset" in cls.__dict__:
            cls.reset = _checked_reset(cls.__dict__["reset"])  # type: ignore[method-assign]
        if "get_state" in cls.__dict__:
            cls.get_state = _checked_get_state(cls.__dict__["get_state"])  # type: ignore[method-assign]

    def __init__(self, *parents: Any) -> None:
        super().__init__()
        for p in parents:
            if not isinstance(p, BaseNode):
                raise TypeError(f"{_describe(self)}: a parent must be a node (a torchdata BaseNode), got "
                                f"{type(p).__name__}")
        key = getattr(type(self), "PARENT", None)
        if not parents and key is not None and key in type(self).STATE_KEYS:
            raise TypeError(f"{_describe(self)} nests its parent's state under {key!r} but declared no parent: pass it "
                            "to the base class, super().__init__(parent), so the graph can be walked (pipes/graph.py)")
        self._parents: Tuple[Any, ...] = tuple(parents)

    @property
    def parents(self) -> Tuple[Any, ...]:
        """The nodes this node pulls from, as declared at construction, in order."""
        return self._parents

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:  # noqa: D401
        BaseNode.reset(self, initial_state)

    def next(self) -> T:  # pragma: no cover - abstract
        raise NotImplementedError(f"{_describe(self)} must implement next()")

    def get_state(self) -> Dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError(f"{_describe(self)} must implement get_state()")


def _checked_reset(fn):
    @functools.wraps(fn)
    def reset(self: Node, initial_state: Optional[Dict[str, Any]] = None) -> None:
        if initial_state is not None:
            check_state_keys(self, initial_state, type(self).STATE_KEYS, type(self).KEYS_ADDED)
        # The BaseNode bookkeeping (lazy-initialisation flag) is done here so a
        # subclass cannot forget it.
        BaseNode.reset(self, initial_state)
        fn(self, initial_state)

    reset.__tokenloom_checked__ = True  # type: ignore[attr-defined]
    return reset


_KEY_SETS: Dict[type, frozenset] = {}


def _key_set(cls: type) -> frozenset:
    """``cls.STATE_KEYS`` as a set, made once per class: the check runs at every state taken."""
    keys = _KEY_SETS.get(cls)
    if keys is None:
        keys = _KEY_SETS[cls] = frozenset(cls.STATE_KEYS)
    return keys


def _checked_get_state(fn):
    @functools.wraps(fn)
    def get_state(self: Node) -> Dict[str, Any]:
        state = fn(self)
        cls = type(self)
        keys = cls.STATE_KEYS
        if len(state) != len(keys) or not state.keys() >= _key_set(cls):
            raise StateError(
                f"{_describe(self)}.get_state() returned keys {sorted(state)} but declares "
                f"STATE_KEYS={list(keys)}; a node must return the same keys at every step"
            )
        return state

    return get_state

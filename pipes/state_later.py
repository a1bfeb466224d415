"""A node's state taken now and read later, for a caller that keeps many states and reads few.

Why: the best-fit packer keeps its parent's state at every replay checkpoint (pack/bestfit.py),
about one a document pulled, and reads only the oldest one still needed, once per state it
gives. Under a mixer of ``n`` sources a state holds ``n`` branch states and lists of ``n``
counters, so taking each checkpoint's in full costs ``O(n)`` copies, and as many frees when the
checkpoint is dropped, at every pull, though a pull moves one source.

The protocol: a node may offer ``state_later()``, returning a `Later` whose ``state()`` is what
``state_dict()`` returned at the call, equal in every value (so a state built from it is the
same, byte for byte, once written out). `later_of` gives what takes a node's state for later:
its ``state_later`` where it has one, else its ``state_dict`` (a plain state, read as it is);
`read_later` turns what either gave into the state. The mixer offers it (pipes/mix.py), from a
journal of what changed between two takes; other nodes' states are small or change whole.
"""

from __future__ import annotations

from typing import Any, Callable


class Later:
    """A state taken for later: ``state()`` gives it, made once (the same object each call)."""

    __slots__ = ()

    def state(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError


def later_of(node: Any) -> Callable[[], Any]:
    """What takes ``node``'s state for later: ``node.state_later`` if it has one, else ``node.state_dict``."""
    take = getattr(node, "state_later", None)
    return take if take is not None else node.state_dict


def read_later(taken: Any) -> Any:
    """The state that what `later_of`'s callable returned stands for."""
    return taken.state() if isinstance(taken, Later) else taken

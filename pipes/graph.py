"""The shape of a graph, declared by its nodes: parents and roles.

Every tokenloom node names its parents when it is built (``Node.__init__(*parents)``; a
mixer its sources in order) and its role as the class constant ``ROLE``. A node of
``torchdata.nodes`` (``Mapper``, ``Filter``, ...) is walked through its own public
``source`` attribute. Whatever needs the graph's shape (a packer's save point, elastic
planning, first fetches, statistics) walks it through `walk` and asks `role_of`: never a
class name, never another object's private attributes. So a graph a user composes of
tokenloom's nodes, their own, and torchdata's is walked like a recipe's.

Roles:

| role | what the node does | what it offers the walkers |
|---|---|---|
| ``SHARD`` | emits the work units of one shard (`ShardUnits`) | its position, a few ints; ``shard``, ``first_epoch``, ``epochs`` (None: endless) |
| ``READER`` | reads a shard's units into documents | ``source``, ``sharder``, ``position()``, ``unread()``, ``next_epoch()`` |
| ``BRANCH`` | turns documents into tokens (`Tokenize`, `RenderChat`) | `Branch` |
| ``PIECES`` | hands long documents out in pieces (`Pieces`) | ``in_flight_origins()`` |
| ``MIX`` | mixes several branches by weight (`Mix`) | ``names``, counters |
| ``PACKER`` | packs documents into rows (`BestFitPack`, `FlatPack`) | ``stats()``, its save point |
| ``BATCH`` | rows into the batch dict (`Batch`) | ``counts()`` |
| ``PASS`` | maps or filters items one at a time and holds none between calls (`WithStats`, a user's filter) | nothing: on another topology it starts afresh |
| ``OTHER`` | anything else (the default for a node that declares nothing) | walked through, nothing asked |

A ``torchdata.nodes`` ``Mapper`` (a ``ParallelMapper`` with ``num_workers=0`` and no ``prebatch``) maps
one item at a time and holds none: it counts as ``PASS``. An elastic resume (pipes/loader/elastic.py)
continues a graph on another topology only when every node has one of the roles above but ``OTHER``
(`check_elastic`): a node that may hold documents between calls (a shuffle buffer, a parallel map)
would lose them there.
"""

from __future__ import annotations

from typing import Any, Iterator, List, Tuple

from torchdata.nodes import BaseNode, ParallelMapper

from .base import Node
from .roles import BATCH, BRANCH, MIX, OTHER, PACKER, PASS, PIECES, READER, ROLES, SHARD  # noqa: F401 (re-exported)


class Branch:
    """What a ``BRANCH`` node offers an elastic resume (the role's protocol): the counters it carries
    to a new shard, under the key ``COUNTERS`` of the carried counters."""

    #: The key its counters are carried under (``"encoded"``: documents encoded from text; ``"chat"``).
    COUNTERS: str = ""

    def counters(self) -> Any:
        """Its counters now, as they are carried (plain data)."""
        raise NotImplementedError

    def counters_as_ints(self) -> List[int]:
        """The same as a list of ints, for a packer's save point (pack/savepoint.py)."""
        raise NotImplementedError

    def counters_from_ints(self, ints: List[int]) -> Any:
        """`counters` from what `counters_as_ints` gave."""
        raise NotImplementedError

    def carry(self, counters: Any) -> None:
        """Continue from the carried ``counters`` (a new shard of an elastic resume)."""
        raise NotImplementedError


def parents_of(node: Any) -> Tuple[Any, ...]:
    """The parents a tokenloom node declared, or a torchdata node's ``source`` (none for a source)."""
    if isinstance(node, Node):
        return node.parents
    source = getattr(node, "source", None)
    return (source,) if isinstance(source, BaseNode) else ()


def role_of(node: Any) -> str:
    """The role a tokenloom node declares (``ROLE``); ``PASS`` for torchdata's one-at-a-time ``Mapper``;
    ``OTHER`` for any other node."""
    if isinstance(node, Node):
        return type(node).ROLE
    if isinstance(node, ParallelMapper) and node.num_workers == 0 and node.prebatch is None:
        return PASS
    return OTHER


def sharders_of(node: Any) -> List[Any]:
    """The ``SHARD`` nodes of the graph under ``node``, in `walk` order (a mixer learns from them how its
    branches end: pipes/mix.py)."""
    return [n for n in walk(node) if role_of(n) == SHARD]


def walk(node: Any) -> Iterator[Any]:
    """Every node of the graph under ``node`` (itself first), depth first, parents in their order."""
    yield node
    for parent in parents_of(node):
        yield from walk(parent)

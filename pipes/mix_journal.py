"""The mixer's states taken for later, kept as what changed since a full one (pipes/state_later.py).

A mixer's state holds, per source, its branch's state and five counters (tokens, documents,
passes, exhausted, midway), and a few scalars (picks, cursor, ended, era). Between two takes
only the sources pulled in between change, unless a change touches every source (new weights'
era, a reset, an elastic carry-over), which the mixer answers with a full state. So a journal
is a full state (its base) and, per take after it, the scalars and, for each source pulled since
the take before, its branch's state and counters: a take costs what was pulled, not the number
of sources. `MixJournal.state_at` rebuilds a take's state: the base's lists and children dict
copied once, the entries up to it applied, the keys in the base's order; every value equals
what the mixer's ``state_dict()`` gave at that take (the branch states are the same objects).
A rebuild starts from the last take rebuilt before it, so a packer reading its checkpoints oldest
first applies each entry about once; a handle makes its state once (`MixLater`). The mixer starts
a new journal every so many takes (`Mix.JOURNAL_MIN`, or the number of sources), so a rebuild
applies at most that many entries.
"""

from __future__ import annotations

from itertools import islice
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .state_later import Later

#: One take after the base: the scalars, then per source pulled ``(index, name, branch state, counters)``.
Entry = Tuple[Tuple[Any, ...], List[Tuple[int, str, Any, Tuple[Any, ...]]]]


class MixJournal:
    """A full mixer state and the takes after it (module docstring).

    Args:
        base: the full state (``Mix.state_dict()``), never changed.
        children_key: the key of the branch states in it.
        list_keys: the keys of the per-source lists the entries change, in the order of each
            entry's counters.
        scalar_keys: the keys of the scalars, in the order of each entry's scalars.
    """

    __slots__ = ("base", "children_key", "list_keys", "scalar_keys", "entries", "_made")

    def __init__(self, base: Dict[str, Any], children_key: str, list_keys: Sequence[str],
                 scalar_keys: Sequence[str]):
        self.base, self.children_key = base, children_key
        self.list_keys, self.scalar_keys = tuple(list_keys), tuple(scalar_keys)
        self.entries: List[Entry] = []
        self._made: Optional[Tuple[int, Dict[str, Any]]] = None  # the last take rebuilt, and its state

    def first(self) -> "MixLater":
        """The base, as a handle."""
        return MixLater(self, 0)

    def add(self, scalars: Tuple[Any, ...], changes: List[Tuple[int, str, Any, Tuple[Any, ...]]]) -> "MixLater":
        """Record a take: its scalars and the sources pulled since the take before."""
        self.entries.append((scalars, changes))
        return MixLater(self, len(self.entries))

    def state_at(self, k: int) -> Dict[str, Any]:
        """The state of take ``k`` (0: the base), rebuilt from the last take rebuilt before it, if any (a
        packer reads its checkpoints oldest first, so each rebuild applies the entries since the last)."""
        start, src = 0, self.base
        made = self._made
        if made is not None and made[0] <= k:
            start, src = made
        if start == k:
            return src
        kids = dict(src[self.children_key])
        lists = [list(src[key]) for key in self.list_keys]
        for _, changes in islice(self.entries, start, k):
            for i, name, kid, counters in changes:
                kids[name] = kid
                for values, v in zip(lists, counters):
                    values[i] = v
        new = dict(zip(self.list_keys, lists))
        new.update(zip(self.scalar_keys, self.entries[k - 1][0]))
        new[self.children_key] = kids
        out = {key: new.get(key, value) for key, value in src.items()}  # the base's keys, in its order
        self._made = (k, out)
        return out


class MixLater(Later):
    """Take ``k`` of a `MixJournal`; its state made at the first ``state()``."""

    __slots__ = ("journal", "k", "_state")

    def __init__(self, journal: MixJournal, k: int):
        self.journal, self.k = journal, k
        self._state: Optional[Dict[str, Any]] = None

    def state(self) -> Dict[str, Any]:
        if self._state is None:
            self._state = self.journal.state_at(self.k)
        return self._state

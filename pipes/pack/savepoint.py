"""A packer's save point in positions and counters, so an elastic resume plans from states alone.

Why: a packer's state restores by replay. Best-fit's nests its parent's state at its replay
window's start (``base``), flat's at its current document's start, a tokenizer's nests its
reader's at its batch's start; so the reader positions, the mixer's totals and the counters
inside a packer's state are those of an earlier point, and what is in flight (the buffered
documents, a tokenizer's batch not yet handed on) is known only once re-read. An elastic
resume needs every old shard's save point; rebuilding and replaying each old shard to learn it
costs a replay per old shard, and a rank after a large run would replay thousands of them.

So with every state a packer also records its save point, under its ``ELASTIC`` key (see
`SavePoint.take`): positions and counters, never tokens or text.

- ``docs``: the documents in flight as rows of six ints ``(source, picked, epoch, unit, pos,
  used)``: the packer's (``picked`` 1: the mixer counted them) with the tokens of each delivered,
  those a tokenizer (or chat renderer) read but has not handed on (0), and the rest of a document
  handed out in pieces (2, pipes/pieces.py), unless the packer holds its earlier pieces: its row
  then covers the whole rest, as the packer appends the pieces to one slot. Sorted, each column
  delta-coded, zlib'd, base64: a few bytes a document (`pack_docs`).
- ``sources``: per source, ``[sharder epoch, sharder index, sharder prefix count, rows of the
  current slice read, epoch of the next row, rows skipped, *branch counters]``: the reader's live
  position (what `UnitCursor.position` saves, which a `ShardUnits` restores without reading),
  the epoch `next_epoch` gives, and the documents encoded (`Tokenize`) or the chat renderer's
  counts (`RenderChat`).
- ``mix``: the mixer's totals ``[tokens, documents, passes, exhausted, era_base]`` (lists per
  source, in the mixer's order), or None without a mixer.
- ``again``: per source, ``[tokens, starts]`` of the packer's documents still to deliver: the
  mixer counted them when they were picked and will count them again in the new shard that gets
  them.

A restored packer stands where its state says but knows the save point only from the summary
it was restored with: until it moves it returns that summary; after, it takes the save point
live, except for the sources whose branch has not read since the restore (they stand where the
restore put them, which the loaded summary describes: a branch only moves when pulled from).

Cost: one Python step per document pulled since the previous state (its origin into a per-slot
table), a few numpy calls over the buffer, one pass per tokenizer batch, and the zlib call; it
grows with the documents in flight, as does the state's size. Under a mixer, a source's entry and
its rows in flight are taken again only when the mixer pulled its branch since the last take
(`Mix.pulled_since`: a branch moves only when pulled), so a take costs Python steps per source
pulled, not per source. Measured by benchmarks/elastic.py
(benchmarks/RESULTS.md, ``elastic``; see docs/performance.md).
"""

from __future__ import annotations

import base64
import zlib
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..graph import BRANCH, MIX, PIECES, READER, Branch, parents_of, role_of, walk
from ..shard import ShardUnits
from ..state_delta import LIST_PATCH_MIN

#: The columns of ``docs``.
DOC_FIELDS = ("source", "picked", "epoch", "unit", "pos", "used")
#: The leading fields of a ``sources`` entry; the branch's counters follow.
SOURCE_FIELDS = ("shard_epoch", "shard_index", "shard_prefix", "row", "next_epoch", "skipped")
#: The lists of ``mix``.
MIX_FIELDS = ("tokens", "documents", "passes", "exhausted", "era_base")


# --- the graph above a packer ------------------------------------------------------------

def reader_states(node: Any, state: Optional[Mapping[str, Any]]) -> Iterator[Tuple[Any, Optional[Mapping[str, Any]]]]:
    """``(reader, its state)`` for every reader of the graph under ``node``, found in ``state``, the
    state ``node`` saved (None: a graph that starts from nothing). A node nests its one parent's
    state under its class's ``PARENT`` key (a packer: as of its replay window's start, where a
    restore reads from), a mixer its parents' under ``CHILDREN``, by name. KeyError: ``state`` is
    not this graph's."""
    if role_of(node) == READER:
        yield node, state
        return
    parents = parents_of(node)
    if role_of(node) == MIX:
        nested = None if state is None else state[type(node).CHILDREN]
        for name, child in zip(node.names, parents):
            yield from reader_states(child, None if nested is None else nested[name])
        return
    key = getattr(type(node), "PARENT", None)
    if key is not None and len(parents) == 1:
        yield from reader_states(parents[0], None if state is None else state[key])


def _first(node: Any, roles: Tuple[str, ...]) -> Any:
    """The first node above ``node`` (itself excluded) with one of ``roles``, or None."""
    return next((n for n in walk(node) if n is not node and role_of(n) in roles), None)


def branch_counts(branch: Any) -> List[int]:
    """The counters a branch carries over an elastic resume (`graph.Branch`), none for another node."""
    return branch.counters_as_ints() if isinstance(branch, Branch) else []


# --- the documents in flight, packed ----------------------------------------------------------

def pack_docs(table: np.ndarray) -> str:
    """Rows of `DOC_FIELDS` as text: sorted (the order carries nothing), each column delta-coded,
    little-endian int64, zlib level 1, base64. Sorted rows of one reader differ by a row or so, so
    the deltas are small and compress to a few bytes a document."""
    n = len(table)
    if n == 0:
        return _EMPTY_TEXT
    if n > 1:  # by source, epoch, unit, pos
        table = table[np.lexsort((table[:, 4], table[:, 3], table[:, 2], table[:, 0]))]
    cols = table.T.astype("<i8")  # (6, n), a copy
    if n > 1:
        cols[:, 1:] -= table.T[:, :-1]
    return base64.b64encode(zlib.compress(cols.tobytes(), 1)).decode("ascii")


def unpack_docs(text: str) -> np.ndarray:
    """The rows `pack_docs` packed, shape (n, 6), sorted."""
    raw = zlib.decompress(base64.b64decode(text.encode("ascii"), validate=True))
    cols = np.frombuffer(raw, dtype="<i8").reshape(len(DOC_FIELDS), -1)
    return np.cumsum(cols, axis=1, dtype=np.int64).T


#: No documents in flight: an empty table of `DOC_FIELDS` rows.
NO_DOCS = np.zeros((0, len(DOC_FIELDS)), np.int64)
_EMPTY_TEXT = base64.b64encode(zlib.compress(b"", 1)).decode("ascii")


class SavePoint:
    """A packer's helper: finds the mixer, readers and branches above it (once, lazily), and takes
    or keeps the summary of the save point (see the module docstring)."""

    DOCS, SOURCES, MIX, AGAIN = "docs", "sources", "mix", "again"
    KEYS = (DOCS, SOURCES, MIX, AGAIN)

    def __init__(self, parent: Any):
        self.parent = parent
        self._found = False
        self.names: List[str] = []
        self.index: Dict[str, int] = {}
        self.readers: List[Any] = []
        self.branches: List[Optional[Any]] = []
        self.pieces: List[Optional[Any]] = []
        self._mix: Any = None
        self.loaded: Optional[Dict[str, Any]] = None
        self._loaded_docs: Optional[np.ndarray] = None
        # Per source, as of the last take: its entry, its rows in flight (tokenizer, loaded) and the
        # rest its pieces node holds; retaken for the sources in _moved (None: every source, each take).
        self._entries: Dict[str, List[int]] = {}
        self._rows: Dict[int, np.ndarray] = {}
        # Per source, the first row its pieces node holds (row i for source i, where _held_on): the rows a
        # take matches against the packer's and sends, one numpy index instead of a Python step per
        # source; the rows after the first (none for `Pieces`, which holds one document) in _held_rest.
        self._held_first = np.zeros((0, len(DOC_FIELDS)), np.int64)
        self._held_rest: Dict[int, np.ndarray] = {}
        self._held_on = np.zeros(0, bool)
        # The last take's ``again`` (the list it sent, and as an array): the next shares its unchanged ints.
        self._again: Optional[Tuple[List[int], np.ndarray]] = None
        self._moved: Optional[set] = None
        self._under: List[List[int]] = []  # per mixer child: the sources read under it

    def _find(self) -> None:
        nodes = list(walk(self.parent))
        self._mix = next((n for n in nodes if role_of(n) == MIX), None)
        # each branch's reader, each pieces node's branch or reader: one walk each, not one per reader
        branch_of = {}
        for b in (n for n in nodes if role_of(n) == BRANCH):
            branch_of.setdefault(id(_first(b, (READER,))), b)
        pieces_of = {}
        for p in (n for n in nodes if role_of(n) == PIECES):
            pieces_of.setdefault(id(_first(p, (BRANCH, READER))), p)
        for reader in nodes:
            if role_of(reader) != READER:
                continue
            name = str(reader.source)
            if name in self.index:
                continue
            self.index[name] = len(self.names)
            self.names.append(name)
            self.readers.append(reader)
            # through any pass-through nodes between them (a user's filter, a torchdata Mapper)
            branch = branch_of.get(id(reader))
            self.branches.append(branch)
            self.pieces.append(pieces_of.get(id(branch or reader)))
        self._found = True
        self._forget()
        if self._mix is not None:
            # Only where each source is read under exactly one of the mixer's children (the recipes,
            # a composed mix of branches) does a pull of a child say which sources moved.
            self._under = [[self.index[str(r.source)] for r in walk(child) if role_of(r) == READER]
                           for child in parents_of(self._mix)]
            covered = sorted(i for under in self._under for i in under)
            if covered == list(range(len(self.names))) and all(role_of(n) != MIX for n in walk(self._mix)
                                                               if n is not self._mix):
                self._moved = self._mix.pulled_since()

    def count(self) -> int:
        """How many sources the summary describes (readers above the packer)."""
        if not self._found:
            self._find()
        return len(self.names)

    def source_of(self, name: str) -> int:
        """The index of source ``name`` in ``docs`` (-1: not a source read by a reader above)."""
        if not self._found:
            self._find()
        return self.index.get(name, -1)

    # --- restore ------------------------------------------------------------------------
    def _forget(self) -> None:
        self._entries = dict.fromkeys(self.names)  # the order the summary lists them in
        self._rows, self._held_rest = {}, {}
        self._again = None
        self._held_first = np.zeros((len(self.names), len(DOC_FIELDS)), np.int64)
        self._held_on = np.zeros(len(self.names), bool)
        if self._moved is not None:
            self._moved.update(range(len(self._under)))

    def load(self, summary: Any) -> None:
        """Keep the summary a packer is restored with (checked strictly)."""
        if not isinstance(summary, dict) or set(summary) != set(self.KEYS):
            got = sorted(summary) if isinstance(summary, dict) else type(summary).__name__
            raise ValueError(f"packer state: the save point summary has keys {got}, expected {list(self.KEYS)}; "
                             "was it saved by another tokenloom version?")
        self.loaded, self._loaded_docs = summary, None
        self._forget()

    def clear(self) -> None:
        self.loaded, self._loaded_docs = None, None
        self._forget()

    def _loaded_rows(self) -> np.ndarray:
        if self._loaded_docs is None:
            self._loaded_docs = unpack_docs(self.loaded[self.DOCS])
        return self._loaded_docs

    # --- take -----------------------------------------------------------------------------
    def take(self, picked: np.ndarray, again: Sequence[int]) -> Dict[str, Any]:
        """The summary of the save point: ``picked`` the packer's documents in flight, rows of
        `DOC_FIELDS` (``picked`` = 1); ``again`` per source ``[tokens, starts]``, flattened (a list or
        an int array)."""
        if not self._found:
            self._find()
        if self._moved is None:
            moved: Sequence[int] = range(len(self.names))
        else:
            moved = [i for child in self._moved for i in self._under[child]]
            self._moved.clear()
        for i in moved:
            self._retake(i)
        parts = [picked] if len(picked) else []
        if self._held_on.any():
            # the rest of a document in pieces, unless the packer holds its earlier pieces (its row covers it)
            held = held_uncovered(self._held_first, self._held_on, picked)
            parts.append(self._held_first[held])
            if self._held_rest:
                parts += [self._held_rest[i] for i in held.tolist() if i in self._held_rest]
        parts += self._rows.values()
        mix = None
        if self._mix is not None:
            c = self._mix.get_state_counters()
            mix = [c["tokens"], c["documents"], c["passes"], list(map(int, map(bool, c["exhausted"]))), c["era_base"]]
        docs = (np.concatenate(parts) if len(parts) > 1 else parts[0]) if parts else NO_DOCS
        # pack_docs sorts the rows, and no document is in two parts: the order of the parts carries nothing
        return {self.DOCS: pack_docs(docs), self.SOURCES: dict(self._entries), self.MIX: mix,
                self.AGAIN: self._again_list(again)}

    def _again_list(self, again: Sequence[int]) -> List[int]:
        """``again`` as a list that is the last take's where nothing changed, or a copy of it with the
        changed ints replaced: a state patch finds what changed by identity (state_delta.py), not by
        comparing 2 ints a source. Lists are never changed once taken (states share them). A short
        list is sent whole when it changes (`state_delta.LIST_PATCH_MIN`): it is only copied."""
        if len(again) < LIST_PATCH_MIN:
            self._again = None
            return again.tolist() if isinstance(again, np.ndarray) else list(again)
        arr = np.asarray(again, np.int64)
        last = self._again
        if last is not None and len(last[1]) == len(arr):
            changed = np.flatnonzero(arr != last[1])
            if not len(changed):
                return last[0]
            if 4 * len(changed) < len(arr):
                out = list(last[0])
                for i, v in zip(changed.tolist(), arr[changed].tolist()):
                    out[i] = v
                self._again = (out, arr)
                return out
        out = arr.tolist()
        self._again = (out, arr)
        return out

    def _retake(self, i: int) -> None:
        """Source ``i``'s entry, its rows in flight and its pieces' held rest, as it stands now."""
        name, reader, branch, pieces = self.names[i], self.readers[i], self.branches[i], self.pieces[i]
        self._held_rest.pop(i, None)
        self._held_on[i] = False
        self._rows.pop(i, None)
        if pieces is not None:
            held = pieces.in_flight_origins(i)
            if len(held):
                self._held_first[i], self._held_on[i] = held[0], True
                if len(held) > 1:
                    self._held_rest[i] = held[1:]
        loaded = self.loaded
        if loaded is not None and branch is not None and branch.untouched_since_restore():
            # Not pulled since the restore: it stands where the save found it (module docstring).
            self._entries[name] = loaded[self.SOURCES][name]
            rows = self._loaded_rows()
            rows = rows[(rows[:, 0] == i) & (rows[:, 1] == 0)]
            if len(rows):
                self._rows[i] = rows
            return
        state, row = reader.position()
        entry = [state[_EPOCH], state[_INDEX], state[_PREFIX], row, reader.next_epoch(), reader.skipped]
        if branch is not None:
            entry += branch_counts(branch)
            rows = branch.in_flight_origins(i)
            if len(rows):
                self._rows[i] = rows
        self._entries[name] = entry


_EPOCH, _INDEX, _PREFIX = ShardUnits.EPOCH, ShardUnits.INDEX, ShardUnits.PREFIX
#: The columns that name a document: source, epoch, unit, pos.
_KEY = [0, 2, 3, 4]


def held_uncovered(first: np.ndarray, on: np.ndarray, picked: np.ndarray) -> np.ndarray:
    """The sources whose pieces node holds a document (``on[i]``, ``first[i]`` its row) that is not
    one of the packer's ``picked`` rows (by source, epoch, unit, pos), in order. A source's held
    document can only be among that source's rows, so each picked row is compared with its own
    source's held row: one numpy pass over the packer's rows, no sort and no Python step per row."""
    covered = np.zeros(len(on), bool)
    if len(picked):
        src = picked[:, 0]
        ok = (src >= 0) & (src < len(on))  # -1: a document of a source no reader above reads
        src = np.where(ok, src, 0)
        same = ok & on[src] & (first[src][:, _KEY] == picked[:, _KEY]).all(axis=1)
        covered[src[same]] = True
    return np.flatnonzero(on & ~covered)


def again_of(src: np.ndarray, length: np.ndarray, used: np.ndarray, n: int) -> Sequence[int]:
    """Per source ``[tokens, starts]`` (flattened; a list, or an int64 array where there are many
    documents) of buffered documents: tokens still to deliver, and those not delivered at all
    (``used == 0``), which the mixer will count again."""
    if n == 0:
        return []
    if len(src) <= 32:  # a few documents (long ones, or flat's one): Python beats numpy's call overhead
        out = [0] * (2 * n)
        for s, ln, u in zip(src.tolist(), length.tolist(), used.tolist()):
            if s >= 0:
                out[2 * s] += ln - u
                out[2 * s + 1] += u == 0
        return out
    keep = src >= 0
    if not keep.all():
        src, length, used = src[keep], length[keep], used[keep]
    out = np.empty((n, 2), np.int64)
    out[:, 0] = np.bincount(src, weights=length - used, minlength=n)[:n]
    out[:, 1] = np.bincount(src, weights=used == 0, minlength=n)[:n]
    return out.ravel()

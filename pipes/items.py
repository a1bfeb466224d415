"""The items that flow between nodes, kept as plain tuples and numpy arrays.

Per-document objects are NamedTuples, which are cheaper to create than dataclasses,
and tokens are numpy arrays, never lists of Python ints.
"""

from __future__ import annotations

from typing import Any, Dict, NamedTuple, Optional, Sequence

import numpy as np

#: Where a graph puts its worker's statistics in a batch (stats.py); tokenloom's loader takes them
#: out before the batch reaches the training loop (they travel as `LoaderBatch.stats`).
STATS_KEY = "_tokenloom_stats"
#: A "batch" holding only this key (and statistics) is dropped by the loader after it took
#: the statistics: how a worker reports what it dropped (a final partial batch) without
#: the training loop seeing it.
DROP_KEY = "_tokenloom_drop"


class Doc(NamedTuple):
    """A document as read: its payload and where it came from.

    ``text`` is a ``str`` for text sources; for structured fields (a jsonl
    ``"messages"`` conversation) it is the parsed JSON value.
    """

    text: Any
    source: str  # the source's name ("code", "web", ...) for mixing and statistics
    unit: int  # index of the work unit in the source's unit table
    row: int  # row inside the unit (file order, not shuffled order)
    epoch: int = 0  # the pass over the source this document belongs to
    pos: int = -1  # its position in the epoch's row order of the unit (what a WorkSlice counts)
    used: int = 0  # tokens of it delivered before an elastic resume (see elastic.py); 0 normally


class TokenDoc(NamedTuple):
    """A tokenized document: int32 token ids (BOS first) and, for conversations, a
    boolean array marking the tokens that are training targets."""

    ids: np.ndarray
    source: str
    mask: Optional[np.ndarray] = None
    epoch: int = 0
    unit: int = -1  # where it came from (`Doc`), so an elastic resume can hand it to another shard
    pos: int = -1
    used: int = 0  # the first ``used`` tokens were delivered before (elastic resume, earlier pieces): pack the rest
    more: bool = False  # a piece of a longer document whose next pieces follow (pieces.py)

    def origin(self) -> tuple:
        return (self.source, self.epoch, self.unit, self.pos)


def origin_rows(docs: Sequence[TokenDoc], source: int) -> np.ndarray:
    """Where ``docs`` come from, as rows ``(source, 0, epoch, unit, pos, used)`` (int64; ``source``:
    the caller's index of their source), the form a packer's save point keeps (pack/savepoint.py)."""
    rows = np.empty((len(docs), 6), np.int64)
    rows[:, 0], rows[:, 1] = source, 0
    if docs:
        rows[:, 2], rows[:, 3] = [d.epoch for d in docs], [d.unit for d in docs]
        rows[:, 4], rows[:, 5] = [d.pos for d in docs], [d.used for d in docs]
    return rows


class Row(NamedTuple):
    """One packed row of ``seq_len + 1`` tokens.

    ``tokens`` is padded with the pad id after ``sum(seg_lens)`` real tokens;
    ``seg_lens`` are the lengths of the row's segments in order; ``mask`` marks the
    training targets (None: every real token is a target).
    ``sources`` names, per segment, the source it came from (for mixing statistics);
    ``starts`` says, per segment, whether it begins its document (False for a chunk
    that continues a document cut across rows). None means every segment starts one.
    """

    tokens: np.ndarray
    seg_lens: np.ndarray
    mask: Optional[np.ndarray]
    sources: tuple
    starts: Optional[np.ndarray] = None


def take(node: Any, n: int) -> list:
    """Up to ``n`` items of ``node`` (fewer where it ends), for a node that works a batch at a time;
    `StopIteration` when it has none left."""
    items = []
    for _ in range(n):
        try:
            items.append(next(node))
        except StopIteration:
            break
    if not items:
        raise StopIteration
    return items


class BatchInFlight:
    """A node that hands on a batch document by document (`Tokenize`, `RenderChat`): the batch and
    what it tells an elastic resume of the documents it read but has not handed on.

    It owns the batch's bookkeeping, which the node's ``_fill`` (re-)reads a batch into: ``_out``
    the batch, ``_batch_state`` the parent's state at its start, ``_emitted`` the documents of it
    handed on, ``_skip`` those a restore must hand on again before new ones (``_fill`` re-reads
    them), ``_untouched`` (restored and not read since), and the ``_origins``/``_origins_of`` cache
    of `in_flight_origins`. Its state keys, which the node's ``STATE_KEYS`` start with: ``PARENT``
    (``"parent"``: the parent's state at the current batch's start) and ``EMITTED`` (``"emitted"``:
    documents of that batch handed on); `_restore_batch` restores them. The node keeps its parent
    as ``self.parent``."""

    PARENT = "parent"
    EMITTED = "emitted"

    def __init__(self, *parents: Any) -> None:
        super().__init__(*parents)
        self._out: list = []
        self._batch_state: Optional[Dict[str, Any]] = None
        self._emitted = 0
        self._skip = 0
        self._untouched = False  # restored from a state and not read since (savepoint.py)
        self._origins: Optional[np.ndarray] = None  # in_flight_origins of the batch _origins_of
        self._origins_of: Optional[list] = None

    def _fill(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__} must implement _fill(): read the next batch into _out")

    def _restore_batch(self, initial_state: Optional[Dict[str, Any]]) -> None:
        """Drop the batch and reset the parent: to the state ``initial_state`` saved at its batch's
        start, with ``EMITTED`` of that batch to hand on again first, or to the start (None)."""
        self._out, self._emitted = [], 0
        self._untouched = initial_state is not None
        if initial_state is None:
            self.parent.reset(None)
            self._batch_state, self._skip = None, 0
        else:
            self._batch_state = initial_state[self.PARENT]
            self.parent.reset(self._batch_state)
            self._skip = int(initial_state[self.EMITTED])

    def in_flight(self) -> list:
        """Documents read but not handed on; re-reads the batch a restore left pending, so the reader
        stands where it stood at the save."""
        if self._skip and self._emitted >= len(self._out):
            self._fill()
        return self._out[self._emitted:]

    def in_flight_origins(self, source: int) -> np.ndarray:
        """The documents read but not handed on as rows ``(source, 0, epoch, unit, pos, used)``
        (`in_flight` without reading; ``source``: the caller's index of this branch's source), for a
        packer's save point (pack/savepoint.py). One Python pass per batch, kept for its later calls."""
        if self._origins_of is not self._out:
            self._origins, self._origins_of = origin_rows(self._out, source), self._out
        return self._origins[self._emitted:]

    def untouched_since_restore(self) -> bool:
        """Restored from a state and not read since: it stands where that state put it, and its
        documents in flight are known only from the state's save point (pack/savepoint.py)."""
        return self._untouched

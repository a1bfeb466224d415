"""Long documents handed out in pieces, so a mix holds its shares from the first batches.

Why: a mixer picks whole documents, and a best-fit packer drains a long one as the rows
it fills. One 100k-token document is ~49 rows at T=2048, and for those rows the loop sees
its source alone, so the delivered shares drift off the mix's weights for as many batches
(measured by benchmarks/shares.py, ``held_out``; see docs/performance.md). Handed out in
pieces of at most ``piece`` tokens (the recipes: one row), a long document takes turns
with the other sources like a run of short ones, and what a source is ahead or behind is
at most a piece plus what the packer holds.

Pieces continue each other. A piece is the document up to the piece's end
(``ids[:end]``, a view) with ``used`` at its start and ``more`` set while pieces follow;
the mixer counts ``len(ids) - used`` tokens for it and a document start only for the
first. The best-fit packer appends each piece to the one it holds (`pack.core.Slots.extend`),
and while more is to come it places the document only as full rows or gap cuts, which end
at a row's end: so the document is cut only at row ends, as if it had come whole, no label
or position is lost at a piece boundary, and the order of its tokens is kept. Only
``bestfit`` takes pieces (``flat`` and ``crop`` would end a segment mid-document); the
recipes put this node between each source's tokenizer and the mixer for ``bestfit`` with
several sources. If the stream ends (a stop rule) while a document is in pieces, its rest
is not read, like every document after the stop.

State: the parent's state just before the document in pieces, the tokens of it handed
out, and its origin (epoch, unit, row) so a save point can name it without reading; a
restore re-reads that one document. The tokenizer gives its state before its last document
on demand (`Tokenize.state_before_last`), so only long documents cost a state; another
parent's state is taken before every document, a cost on every short document too
(measured by benchmarks/pieces_cost.py).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from .base import Node, StateError
from .items import TokenDoc
from .roles import PIECES

#: ``picked`` of a save point row (pack/savepoint.py) for the rest of a document held here.
HELD = 2


class Pieces(Node[TokenDoc]):
    """Hands out a document longer than ``piece`` tokens as consecutive pieces (module docstring);
    shorter documents pass through unchanged.

    Args:
        parent: a node of `TokenDoc` (a source's tokenizer); with ``state_before_last`` (`Tokenize`)
            its state is asked only for long documents, otherwise it is taken before every document.
        piece: the most tokens a piece adds (>= 1; the recipes use ``seq_len + 1``, one row).

    State keys: ``PARENT`` (the parent's state just before the document held in pieces, or its
    current state when none is held), ``OFFSET`` (tokens of the held document handed out, the next
    piece's start; 0 when none is held) and ``ORIGIN`` (``[epoch, unit, pos]`` of the held document,
    ``[]`` when none is held). A restore re-reads that one document and checks its origin.
    """

    ROLE = PIECES
    PARENT = "parent"
    OFFSET = "offset"  # tokens of the held document handed out (its next piece's start); 0: none held
    ORIGIN = "origin"  # [epoch, unit, pos] of the held document; [] when none is held
    STATE_KEYS = (PARENT, OFFSET, ORIGIN)

    def __init__(self, parent: Node[TokenDoc], *, piece: int):
        super().__init__(parent)
        if piece < 1:
            raise ValueError(f"{piece=} must be >= 1 (tokens per piece; the recipes use seq_len + 1)")
        self.parent, self.piece = parent, int(piece)
        # The parent's state before its last document (Tokenize.state_before_last), asked only when a
        # document is long; a parent without it gets its state taken before every document.
        self._rewind = getattr(parent, "state_before_last", None)
        self._doc: Optional[TokenDoc] = None
        self._off = 0
        self._before: Any = None
        self._pending: Optional[tuple] = None  # (offset, origin) restored, the document not re-read yet

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._doc, self._off, self._before, self._pending = None, 0, None, None
        if initial_state is None:
            self.parent.reset(None)
            return
        self.parent.reset(initial_state[self.PARENT])
        off = int(initial_state[self.OFFSET])
        if off:
            self._pending = (off, [int(x) for x in initial_state[self.ORIGIN]])
            self._before = initial_state[self.PARENT]

    def _reread(self) -> None:
        off, origin = self._pending
        self._pending = None
        doc = self.parent.next()
        got = [doc.epoch, doc.unit, doc.pos]
        if got != origin or len(doc.ids) <= off:
            raise StateError(f"Pieces: the state holds {off} tokens of the document at (epoch, unit, row) {origin} of "
                             f"source {doc.source!r}, but re-reading gave {got} with {len(doc.ids)} tokens; the data "
                             "or the tokenizer changed since the state was saved")
        self._doc, self._off = doc, off

    def next(self) -> TokenDoc:
        if self._pending is not None:
            self._reread()
        doc = self._doc
        if doc is None:
            before = None if self._rewind is not None else self.parent.state_dict()
            doc = self.parent.next()
            if len(doc.ids) - doc.used <= self.piece:
                return doc
            self._doc, self._off = doc, doc.used
            self._before = self._rewind() if self._rewind is not None else before
        start = self._off
        end = min(start + self.piece, len(doc.ids))
        more = end < len(doc.ids)
        self._off = end
        if not more:
            self._doc = self._before = None
        # by position (TokenDoc's fields: ids, source, mask, epoch, unit, pos, used, more): _replace's keyword
        # lookups cost more than the rest of a piece
        ids, source, mask, epoch, unit, pos = doc[:6]
        return type(doc)(ids[:end], source, None if mask is None else mask[:end], epoch, unit, pos, start, more)

    def get_state(self) -> Dict[str, Any]:
        if self._pending is not None:
            off, origin = self._pending
            return {self.PARENT: self._before, self.OFFSET: off, self.ORIGIN: list(origin)}
        if self._doc is None:
            return {self.PARENT: self.parent.state_dict(), self.OFFSET: 0, self.ORIGIN: []}
        d = self._doc
        return {self.PARENT: self._before, self.OFFSET: self._off, self.ORIGIN: [d.epoch, d.unit, d.pos]}

    def in_flight_origins(self, source: int) -> np.ndarray:
        """The rest of the held document as a save point row ``(source, HELD, epoch, unit, pos, used)``
        (none when no document is held), for a packer's save point (pack/savepoint.py)."""
        if self._pending is not None:
            off, (epoch, unit, pos) = self._pending
            return np.asarray([[source, HELD, epoch, unit, pos, off]], np.int64)
        if self._doc is None:
            return _NONE
        d = self._doc
        return np.array([[source, HELD, d.epoch, d.unit, d.pos, self._off]], np.int64)


_NONE = np.zeros((0, 6), np.int64)

"""Flat packing: documents laid end to end and cut into rows of ``seq_len + 1`` tokens.

No padding and nothing dropped (only the very last row of a finite stream is
padded); a row may start in the middle of a document, which then restarts its
positions at 0 in the new row. This is nanochat's original loader, with an exact
position as its state: the upstream state just before the current document
plus how many of its tokens were already placed.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..base import Node
from ..items import Row, TokenDoc
from ..roles import PACKER
from .savepoint import SavePoint
from .stats import load_stats, new_stats


_NO_ROWS = np.zeros((0, 6), np.int64)


class FlatPack(Node[Row]):
    """Rows of ``seq_len + 1`` tokens, documents concatenated: rows may start mid-document; nothing is
    padded but a stream's last row, nothing dropped.

    Args:
        parent: a node of `TokenDoc`.
        seq_len: a row holds ``seq_len + 1`` tokens.
        pad_id: the id the stream's last row is padded with.

    State keys: ``PARENT`` (the parent's state before the current document), ``OFFSET`` (its tokens
    already in rows), ``STATS`` (the packing statistics) and ``ELASTIC`` (the save point,
    pack/savepoint.py). A restore re-reads the current document.
    """

    ROLE = PACKER
    PARENT = "parent"
    OFFSET = "offset"
    STATS = "stats"
    #: The save point in positions and counters, for an elastic resume (savepoint.py).
    ELASTIC = "elastic"
    STATE_KEYS = (PARENT, OFFSET, STATS, ELASTIC)

    def __init__(self, parent: Node[TokenDoc], *, seq_len: int, pad_id: int = 0):
        super().__init__(parent)
        if seq_len < 1:
            raise ValueError(f"{seq_len=} must be >= 1")
        self.parent, self.row_len, self.pad_id = parent, seq_len + 1, pad_id
        self._doc: Optional[TokenDoc] = None
        self._doc_state: Optional[Dict[str, Any]] = None
        self._off = 0
        self._skip = 0
        self._stats = new_stats()
        self._savepoint = SavePoint(parent)
        self._moved = False  # next() ran since the reset: the loaded save point no longer describes it

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._doc, self._moved = None, False
        if initial_state is None:
            self.parent.reset(None)
            self._doc_state, self._skip, self._stats = None, 0, new_stats()
            self._savepoint.clear()
        else:
            self._doc_state = initial_state[self.PARENT]
            self.parent.reset(self._doc_state)
            self._savepoint.load(initial_state[self.ELASTIC])
            self._skip = int(initial_state[self.OFFSET])
            self._stats = load_stats(initial_state[self.STATS])

    def next(self) -> Row:
        self._moved = True
        C = self.row_len
        tokens = np.full(C, self.pad_id, dtype=np.int32)
        mask: Optional[np.ndarray] = None
        seg_lens: List[int] = []
        sources: List[str] = []
        starts: List[bool] = []
        pos = 0
        while pos < C:
            if self._doc is None:
                if pos == C - 1:
                    # The label slot: a row's last token is only the target of the input before
                    # it, and after a whole document the end label replaces it, so a piece
                    # starting there would be neither input nor target. It stays padding and
                    # the next document starts the next row.
                    break
                self._doc_state = self.parent.state_dict()
                try:
                    self._doc = next(self.parent)
                except StopIteration:
                    break
                if getattr(self._doc, "more", False):
                    raise ValueError(f"FlatPack got a piece of a document from source {self._doc.source!r} "
                                     "(pipes/pieces.py): flat rows would end it mid-row. Feed FlatPack whole documents "
                                     "(no Pieces node), or pack with BestFitPack(mode='bestfit')")
                self._off, replayed, self._skip = self._skip, self._skip > 0, 0
                if not replayed:
                    # used > 0: its first tokens were delivered before an elastic resume
                    n, self._off = len(self._doc.ids), self._doc.used
                    self._stats["tokens_in"] += n - self._off
                    self._stats["documents"] += self._off == 0
                    self._stats["chunked"] += int(n > C and self._off == 0)
            doc = self._doc
            take = min(C - pos, len(doc.ids) - self._off)
            tokens[pos:pos + take] = doc.ids[self._off:self._off + take]
            if doc.mask is not None:
                if mask is None:
                    mask = np.zeros(C, dtype=bool)
                mask[pos:pos + take] = doc.mask[self._off:self._off + take]
            seg_lens.append(take)
            sources.append(doc.source)
            starts.append(self._off == 0)
            pos += take
            self._off += take
            if self._off >= len(doc.ids):
                self._doc = None
        if pos == 0:
            raise StopIteration
        self._stats["tokens_out"] += pos
        self._stats["padding"] += C - pos
        self._stats["rows"] += 1
        return Row(tokens, np.asarray(seg_lens, dtype=np.int32), mask, tuple(sources), np.asarray(starts, dtype=bool))

    def get_state(self) -> Dict[str, Any]:
        if self._doc is None:
            parent = self._doc_state if self._skip else self.parent.state_dict()
            return {self.PARENT: parent, self.OFFSET: self._skip, self.STATS: dict(self._stats),
                    self.ELASTIC: self._save_point()}
        return {self.PARENT: self._doc_state, self.OFFSET: self._off, self.STATS: dict(self._stats),
                self.ELASTIC: self._save_point()}

    def _save_point(self) -> Dict[str, Any]:
        """The save point's summary (savepoint.py): the document being cut, with the positions and
        counters above the packer."""
        point = self._savepoint
        if not self._moved and point.loaded is not None:
            return point.loaded
        n = point.count()
        again = [0] * (2 * n)
        if self._doc is None:
            return point.take(_NO_ROWS, again)
        d, off = self._doc, self._off
        src = point.source_of(d.source)
        if src >= 0:
            again[2 * src], again[2 * src + 1] = len(d.ids) - off, int(off == 0)
        return point.take(np.array([(src, 1, d.epoch, d.unit, d.pos, off)], np.int64), again)

    def in_flight(self) -> List[Tuple[TokenDoc, int]]:
        """The document being cut into rows and how many of its tokens were delivered (for an
        elastic resume; a restored position is re-read first)."""
        if self._doc is None and self._skip:
            self._doc_state = self.parent.state_dict()
            self._doc = next(self.parent)
            self._off, self._skip = self._skip, 0
        return [] if self._doc is None else [(self._doc, self._off)]

    def carry_stats(self, stats: Dict[str, int]) -> None:
        """Continue the statistics of an elastic resume (elastic.py)."""
        self._stats = load_stats(stats)

    def stats(self) -> Dict[str, int]:
        return dict(self._stats)

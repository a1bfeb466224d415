"""The buffer of a best-fit packer: slots, a length index, and one row at a time.

Rules for one row of ``C`` tokens (the same in ``_packcore.c`` and ``_packcore_py.py``):

0. ``crop``: a document of ``C`` tokens or more (the oldest such) starts a row of its
   own: it fills the row whatever else is buffered and loses its rest anyway;
   ``bestfit``, when no document is overdue: if a document has at least ``2C`` tokens
   left, the oldest such gives the whole row (a full chunk; the bulk of long documents
   never waits);
1. overdue documents (``forced``, oldest first) start the row while they fit;
2. repeatedly place the largest next-segment that fits the space left (a row's last
   token, the label slot, stays padding in both modes: only a target, it would hold no
   input of a segment starting there, in ``crop`` a document's BOS alone); ties go to
   the oldest document (lowest sequence number). A document's next segment is
   ``min(remaining, C)`` tokens, so a document longer than a row is cut into chunks
   that each fit a row;
3. when nothing fits:
   - ``bestfit``: cut the gap (if at least ``min_fill`` tokens) off the oldest
     document longer than a row, which must be cut anyway; a document that fits
     in a row is never cut. Otherwise pad.
   - ``crop``: crop the smallest document that does not fit (it loses the least)
     and discard its rest. Documents longer than a row keep only the first ``C``
     tokens, so every segment starts with its document's first token (BOS).
     Once upstream has ended (``ended``), pad instead: no later row needs the gap
     filled, and every buffered document still gets a row of its own, so the
     last rows of a finite stream are padded rather than their documents cropped.

A document arriving in pieces (pipes/pieces.py) has one slot that each piece extends
(`Slots.extend`). While more pieces are to come it is *open*: placed only as a full row
(rules 0 and 2, next segment ``C``) or a gap cut (rule 3), which end at the row's end, and
parked out of the index while it has a row or less left; so it is cut where it would be
cut had it come whole, never ended mid-row.

The index is a list of slots per next-segment length, each ordered by sequence
number, plus a bitmap of non-empty lengths: a placement is a scan of ``C/64``
words, independent of the buffer size. Because the order depends only on the
buffered ``(seq, length, used)`` triples, rebuilding the buffer from a saved
position gives the identical index, and therefore identical rows.
"""

from __future__ import annotations

from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import numpy as np

try:
    from . import _packcore as _core  # type: ignore[attr-defined]

    IMPLEMENTATION = "c"
except ImportError:  # built without a C compiler: same rules, about 20x slower
    from . import _packcore_py as _core

    IMPLEMENTATION = "python"

MODES = {"bestfit": 0, "crop": 1}


class Slots:
    """Fixed-capacity document slots plus the length index, all in numpy arrays."""

    def __init__(self, capacity: int, row_len: int, *, mode: str = "bestfit", min_fill: int = 1,
                 core=None):
        if mode not in MODES:
            raise ValueError(f"{mode=} is not one of {sorted(MODES)}")
        self.C, self.mode, self.min_fill = row_len, MODES[mode], min_fill
        self.core = _core if core is None else core
        S = capacity
        self.seq = np.full(S, -1, np.int64)
        self.len = np.zeros(S, np.int32)
        self.used = np.zeros(S, np.int32)
        self.next = np.full(S, -1, np.int32)
        self.prev = np.full(S, -1, np.int32)
        self.head = np.full(row_len + 1, -1, np.int32)
        self.tail = np.full(row_len + 1, -1, np.int32)
        self.bits = np.zeros((row_len >> 6) + 1, np.uint64)
        self.opened = np.zeros(S, np.uint8)  # 1: the document's next pieces are still to come (extend)
        # The parked slots (`parked`) and the tokens each holds, kept as they change (an open slot is
        # added, extended, closed or placed from), so a packer need not scan its open slots each row.
        self.parked_rest: Dict[int, int] = {}
        self.parked_tokens = 0
        self.docs: List[np.ndarray] = [_EMPTY] * S
        self.masks: List[Optional[np.ndarray]] = [None] * S
        self.free = list(range(S - 1, -1, -1))
        self.owner: List[int] = [-1] * S  # slot -> seq of the document in it
        self.occupied = 0
        self.row_taken = 0  # tokens the row being built took out of the buffer so far (placed or discarded)
        self._pending: tuple = ([], [], [], [])  # staged (slots, seqs, lengths, used)
        self.source: List[str] = [""] * S
        self.masked = 0  # buffered documents that carry a loss mask
        self._row = np.zeros(row_len, np.int32)
        self._rowmask = np.zeros(row_len, np.uint8)
        self._seglen = np.zeros(row_len, np.int32)
        self._segslot = np.zeros(row_len, np.int32)
        self._segoff = np.zeros(row_len, np.int32)
        self._freed = np.zeros(S, np.int32)

    def __len__(self) -> int:
        return self.occupied

    @property
    def capacity(self) -> int:
        """Slots allocated; `add` doubles them when all are taken."""
        return len(self.seq)

    def _grow(self) -> None:
        # The packer's document bound does not count documents arriving in pieces (at most one per
        # source), so the slots it needs can exceed the bound it was built with.
        S = self.capacity
        self.seq = np.concatenate([self.seq, np.full(S, -1, np.int64)])
        for name in ("len", "used", "opened", "_freed"):
            a = getattr(self, name)
            setattr(self, name, np.concatenate([a, np.zeros(S, a.dtype)]))
        for name in ("next", "prev"):
            setattr(self, name, np.concatenate([getattr(self, name), np.full(S, -1, np.int32)]))
        self.docs += [_EMPTY] * S
        self.masks += [None] * S
        self.owner += [-1] * S
        self.source += [""] * S
        self.free = list(range(2 * S - 1, S - 1, -1)) + self.free

    def add(self, seq: int, ids: np.ndarray, used: int = 0, mask: Optional[np.ndarray] = None,
            source: str = "", more: bool = False) -> int:
        """Stage a document; it joins the index at the next `build_row` (one C call per refill).
        ``more``: it is a piece whose document goes on in pieces still to come (`extend`); until
        then it is placed only as full rows or gap cuts, which end at a row's end."""
        if not self.free:
            self._grow()
        s = self.free.pop()
        self.occupied += 1
        self.docs[s] = ids
        self.owner[s] = seq
        self.source[s] = source
        if mask is not None:
            self.masks[s] = mask.view(np.uint8) if mask.dtype == np.bool_ else mask.astype(np.uint8)
            self.masked += 1
        if more:
            self.opened[s] = 1
            if len(ids) - used <= self.C:  # parked: set up now, indexed when its next piece comes
                self.seq[s], self.len[s], self.used[s] = seq, len(ids), used
                self._note(s)
                return s
        p = self._pending
        p[0].append(s)
        p[1].append(seq)
        p[2].append(len(ids))
        p[3].append(used)
        return s

    def _flush(self) -> None:
        p = self._pending
        if p[0]:
            self.core.insert_many(self.seq, self.len, self.used, self.head, self.tail, self.next, self.prev,
                                  self.bits, self.C, *p)
            self._pending = ([], [], [], [])

    def parked(self, s: int) -> bool:
        """An open slot with a row or less left: out of the index until its next piece."""
        self._flush()  # a staged slot's length is in the index's arrays only once flushed
        return bool(self.opened[s]) and int(self.len[s]) - int(self.used[s]) <= self.C

    def waiting(self, s: int, parked: bool = False) -> int:
        """Tokens slot ``s`` holds that may be placed now (``parked``: that may not, parked)."""
        parked_now = self.parked(s)  # flushes first: a staged slot's length is in the arrays only then
        rest = int(self.len[s]) - int(self.used[s])
        return rest if parked_now == parked else 0

    def extend(self, s: int, ids: np.ndarray, mask: Optional[np.ndarray] = None, more: bool = False) -> int:
        """The next piece of slot ``s``'s document: ``ids`` (and ``mask``) are the document up to the
        new piece's end, the same tokens before it. Returns the tokens added."""
        self._flush()
        was_parked = self.parked(s)
        added = len(ids) - int(self.len[s])
        self.docs[s] = ids
        if mask is not None:
            if self.masks[s] is None:
                self.masked += 1
            self.masks[s] = mask.view(np.uint8) if mask.dtype == np.bool_ else mask.astype(np.uint8)
        self.len[s] = len(ids)
        self.opened[s] = 1 if more else 0
        # An indexed slot has more than a row left, so its next segment stays a full row: its place
        # in the index does not change. A parked one joins the index once it may be placed.
        self._unpark(s, was_parked)
        self._note(s)
        return added

    def _note(self, s: int) -> None:
        """Slot ``s`` may have been parked or unparked: `parked_rest` and `parked_tokens` follow."""
        rest = int(self.len[s]) - int(self.used[s])
        old = self.parked_rest.pop(s, None)
        if old is not None:
            self.parked_tokens -= old
        if self.opened[s] and rest <= self.C:
            self.parked_rest[s] = rest
            self.parked_tokens += rest

    def _unpark(self, s: int, was_parked: bool) -> None:
        if was_parked and not self.parked(s) and int(self.len[s]) > int(self.used[s]):
            self.core.insert(self.seq, self.len, self.used, self.head, self.tail, self.next, self.prev, self.bits,
                             s, self.C)

    def close(self, s: int) -> None:
        """No more pieces will come for slot ``s`` (upstream ended): what it holds is placed as a
        whole document's end."""
        self._flush()
        if self.opened[s]:
            was_parked = self.parked(s)
            self.opened[s] = 0
            self._unpark(s, was_parked)
            self._note(s)

    def used_array(self) -> np.ndarray:
        """Tokens already taken from each slot's document (all slots; staged ones included)."""
        self._flush()
        return self.used

    def _release(self, nfreed: int, freed_seqs: List[int]) -> None:
        for s in self._freed[:nfreed].tolist():
            freed_seqs.append(self.owner[s])
            self.owner[s] = -1
            self.opened[s] = 0
            self.parked_tokens -= self.parked_rest.pop(s, 0)  # none is: an open slot is never freed
            self.docs[s] = _EMPTY
            if self.masks[s] is not None:
                self.masks[s] = None
                self.masked -= 1
            self.free.append(s)
        self.occupied -= nfreed

    def build_row(self, top_up: Callable[[], bool], forced: Sequence[int] = (), ended: Optional[bool] = None) -> PackedRow:
        """Build one row. ``top_up()`` refills the buffer and returns whether upstream has
        ended; it is called before placing (unless the caller just did: ``ended``, what it
        returned) and again whenever nothing fits after documents left the buffer, so gaps
        are only cut, cropped or padded from a full buffer.
        ``forced`` are overdue slots, oldest first, placed at the row start while they fit.
        Tokens past the segments are zero (the caller pads)."""
        pos = nseg = 0
        discarded = cut = 0
        sources: List[str] = []
        freed_seqs: List[int] = []
        if ended is None:
            ended = top_up()
        self._flush()
        use_mask = self.masked > 0
        forced_arr = np.asarray(forced, dtype=np.int32) if len(forced) else _NO_SLOTS
        nforced = len(forced_arr)
        while True:
            before = nseg
            nseg, pos, nfreed, d, c, stuck = self.core.build_row(
                self.docs, self.masks if use_mask else None, self.seq, self.len, self.used, self.head, self.tail,
                self.next, self.prev, self.bits, self._row, self._rowmask if use_mask else None, self._seglen,
                self._segslot, self._segoff, self._freed, forced_arr, self.opened, self.C, self.mode, nforced,
                self.min_fill, pos, nseg, 0, int(ended))
            discarded, cut, nforced = discarded + d, cut + c, 0
            placed = self._segslot[before:nseg].tolist()
            opened = self.opened
            for s in placed:
                if opened[s]:  # an open slot left with a row or less is parked
                    self._note(s)
            # Capture what the freed slots held before a refill reuses them.
            sources.extend(self.source[s] for s in placed)
            self._release(nfreed, freed_seqs)
            if not stuck:
                break
            self.row_taken = pos + discarded
            ended = top_up()
            self._flush()
            if self.masked > 0 and not use_mask:
                # the refill brought the first masked document into this row: earlier segments are all targets
                self._rowmask[:pos] = 1
                use_mask = True
        self.row_taken = 0
        mask = self._rowmask.astype(bool) if use_mask else None
        return PackedRow(self._row.copy(), mask, self._seglen[:nseg].copy(), tuple(sources), int(discarded),
                         int(cut), freed_seqs, self._segoff[:nseg] == 0)


_NO_SLOTS = np.zeros(0, np.int32)


class PackedRow(NamedTuple):
    tokens: np.ndarray
    mask: Optional[np.ndarray]
    seg_lens: np.ndarray
    sources: tuple
    discarded: int
    newly_cut: int
    freed_seqs: List[int]
    starts: np.ndarray  # per segment: does it begin its document


_EMPTY = np.zeros(0, np.int32)

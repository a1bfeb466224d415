"""Best-fit packing from a bounded buffer (``bestfit``), and its cropping variant (``crop``).

Per row of ``C = seq_len + 1`` tokens the buffer is topped up to at most
``buffer_size`` documents and `fill_limit` tokens, then segments are placed by
the rules in `core`: a document of a row or more starts a row of its own
(``crop``); overdue documents start the row; else a document with at least
``2C`` tokens left gives a full row (``bestfit``); then the largest that fits, ties
to the oldest; gaps filled from a document longer than a row in ``bestfit``, or
by cropping the smallest non-fitting document in ``crop``. Placement is a
bitmap scan over segment lengths in C, O(C/64) per placement and independent of
the buffer size.

``bestfit`` never drops a token: padding appears only when no buffered
document is longer than a row and nothing fits the gap. ``crop`` gives
nanochat-compatible rows (each segment, so each row, starts with a document's
first token; no padding among the inputs) and discards the rest of every cropped
document; its floor is the tokens beyond ``C`` of documents longer than a row. A
gap of one token is the label slot (the row's last token, a target only): as in
``bestfit`` it stays padding after the whole document before it (whose label is the
end label), since a document placed there would be its BOS alone and never begin. Once a finite
upstream has ended, ``crop`` pads the gaps instead of cropping: the buffer then
drains into its last rows, each buffered document whole (or its first ``C``
tokens), so none is cut down to a scrap, or to its BOS alone in a row's label
slot, only because the stream ended. Measured in benchmarks/RESULTS.md.

The buffer is bounded in tokens as well as documents (``buffer_tokens``, by
default ``BESTFIT_ROWS`` = 16 rows' worth in ``bestfit``, half a row per document of
``buffer_size`` in ``crop``), and it ramps up: before row ``r`` it may hold
``RAMP_START + r // RAMP_EVERY`` rows' worth of tokens (`fill_limit`). So the first
row waits for about one row of tokens instead of a whole buffer (a large buffer on
long documents would otherwise hold the whole of each worker's shard before the first
row), and a restore re-reads a window bounded in tokens, not only in documents. The
ramp is a function of the rows emitted, which the state saves, so a restore fills
exactly as the run that saved. Trade-off: a larger token bound pads less (most where
many documents lie between half a row and a row, as on man-page lengths) but makes the
first batch wait longer and the restore window larger; the ramp pads in the first rows
only. ``crop`` keeps a larger default because it loses less the more short documents it
can choose from. Measured at T=2048 by benchmarks/first_batch.py and
benchmarks/packing.py; see docs/performance.md and benchmarks/RESULTS.md.

Delay bound: documents pulled more than ``max_wait`` pulls, or more than
``buffer_tokens`` tokens, ago start the next rows, oldest first, as many per row
as fit, so a short document waits about ``max_wait`` pulls and a long one
drains as soon as it arrives (its last ``< 2C`` tokens wait like a short
document). Overdue documents come before draining: the other way round, the
short remainder of a drained document would wait while document after document of
two rows or more drained, and the window a restore re-reads would grow past the
token bound (tests/test_packing_ramp.py). Without these rules largest-first keeps the
longest documents waiting (nanochat's crop-shortest rule keeps them forever) and, on
real data where most tokens are in long documents, the buffer fills with them.
Default ``max_wait = buffer_size``: it pads less than ``max_wait = 2 * buffer_size``
because the short overdue documents fill gaps, and it shrinks the window a restore
re-tokenizes (measured by benchmarks/packing.py). In ``crop`` the bound
costs discards where short documents are scarce: a policy that never forces
(the "simple" rule in packing.py) keeps the rare short documents for the small
gaps next to documents of nearly a row, some of them for the whole stream; with
the bound, rows take them earlier. packing.py measures both side by side.

Long documents from a mixer may come in pieces (pipes/pieces.py, the recipes' default for
``bestfit`` with several sources): a piece is appended to the slot its document has (see
`core`), so rows are cut as if the document had come whole. A document in pieces (at most one
a source) counts toward neither bound while it is open, and a parked piece (a row or less left,
the rest to come) cannot be placed; so the buffer may hold ``buffer_size`` documents plus one a
source, and it refills whenever nothing in it can be placed. Invariant: every row before the
stream's end holds at least one token.

State (a position, never the buffer): the upstream state just before the pull
of document number ``base`` (checkpoints every ``CHECKPOINT_EVERY`` pulls or
``CHECKPOINT_ROWS`` rows' worth of tokens, at or before the pull each buffered
document is re-read from), the number of documents pulled, the offsets from ``base``
of the documents still buffered and how many tokens of each were already used. A
restore re-reads and re-tokenizes the window ``[base, pulled)``, bounded by the
delay bound, and re-inserts the listed documents; the index is a function of
those alone, so the rows that follow are identical. At ``buffer_size=1000`` the
state is at most ~1000 small ints, a few KB.

A document that came in pieces is re-read from its latest piece, which holds the whole
document up to there (pipes/pieces.py), not from its first: with many sources its next
piece comes only with its source's next turn, so its first piece can lie thousands of
pulls back, and a window reaching back to it made a restore re-read all of them
(docs/performance.md, "Many sources"). Such a document keeps the number of its first
piece (it orders the index) and may begin before ``base``; the state lists the pull of
its latest piece and the tokens pulled up to its first (the delay bound counts them).
Checkpoints no state can start from any more are dropped (`_thin_checkpoints`). A checkpoint's
upstream state is taken for later (pipes/state_later.py) and read only for the oldest: under a
mixer it records the sources pulled since the checkpoint before (pipes/mix_journal.py), not a copy
of every source's state, at about one checkpoint a document pulled.
"""

from __future__ import annotations

from collections import deque
from heapq import heapify, heappop, heappush
from itertools import chain
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from ..base import Node, StateError
from ..items import Row, TokenDoc
from ..roles import PACKER
from ..state_later import later_of, read_later
from .core import Slots
from .savepoint import SavePoint, again_of
from .stats import load_stats, new_stats


_NO_ROWS = np.zeros((0, 6), np.int64)


#: What a restore that cannot rebuild the buffer means, and what to do.
_NOT_THE_SAME = ("upstream does not give the documents it gave before the save. A node above does not restore "
                 "exactly (its state misses something it changes: a counter, a random generator, a buffer), or the "
                 "data changed; check your nodes with tokenloom.testing.check_node_resume")


class BestFitPack(Node[Row]):
    """Rows of ``seq_len + 1`` tokens packed best-fit from a bounded buffer (module docstring).

    Args:
        parent: a node of `TokenDoc` (a branch, a mixer, pieces).
        seq_len: a row holds ``seq_len + 1`` tokens (inputs and the shifted labels).
        buffer_size: documents the buffer holds (documents arriving in pieces come on top, one a source).
        pad_id: the id padding rows are filled with.
        max_wait: pulls after which a buffered document is overdue (default ``buffer_size``).
        mode: ``"bestfit"`` (nothing dropped) or ``"crop"`` (rows start with a document; padded
            only in the label slot and once upstream has ended).
        min_fill: the least gap ``bestfit`` cuts from a long document rather than padding.
        buffer_tokens: tokens the buffer holds (default `resolve_buffer_tokens`).
        ramp: let the token bound grow from one row's worth (the first rows come sooner).

    State keys: ``PARENT`` (the parent's state at the replay window's start, document number
    ``BASE``), ``PULLED`` (documents pulled), ``LIVE`` and ``CONSUMED`` (the buffered documents, as
    offsets from ``BASE``, and the tokens of each delivered), ``ENDED``, ``STATS`` (the packing
    statistics), ``ELASTIC`` (the save point, pack/savepoint.py) and ``REPULL`` (per buffered
    document re-read from a later piece: ``[its offset, its latest piece's pull, tokens pulled up to
    its first]``, offsets from ``BASE``; missing from states saved before it: none). A restore
    re-reads ``[BASE, PULLED)`` and re-inserts the live documents: a position, never the buffer.
    """

    ROLE = PACKER
    PARENT = "parent"
    BASE = "base"
    PULLED = "pulled"
    LIVE = "live"
    CONSUMED = "consumed"
    ENDED = "ended"
    STATS = "stats"
    #: The save point in positions and counters, for an elastic resume (savepoint.py).
    ELASTIC = "elastic"
    #: Buffered documents that came in pieces, re-read from their latest piece (module docstring, "State").
    REPULL = "repull"
    STATE_KEYS = (PARENT, BASE, PULLED, LIVE, CONSUMED, ENDED, STATS, ELASTIC, REPULL)
    #: Missing from states saved before loader state version 8: none re-read from a later piece.
    KEYS_ADDED = (REPULL,)

    #: Upstream states are remembered every this many pulls, or once this many rows' worth of tokens were
    #: pulled since the last one: a restore replays at most that much before the oldest buffered document.
    CHECKPOINT_EVERY = 32
    CHECKPOINT_ROWS = 1
    #: Default ``buffer_tokens``: ``bestfit`` pads next to nothing from a few dozen rows' worth, so a fixed
    #: number of rows; ``crop`` loses less the more short documents it can choose from, so half a row per
    #: document of ``buffer_size``.
    BESTFIT_ROWS = 16
    #: The ramp: before row ``r`` the buffer may hold ``(RAMP_START + r / RAMP_EVERY)`` rows' worth of tokens.
    RAMP_START = 1
    RAMP_EVERY = 2

    def __init__(self, parent: Node[TokenDoc], *, seq_len: int, buffer_size: int = 1000, pad_id: int = 0,
                 max_wait: Optional[int] = None, mode: str = "bestfit", min_fill: int = 1,
                 buffer_tokens: Optional[int] = None, ramp: bool = True):
        super().__init__(parent)
        if seq_len < 1:
            raise ValueError(f"{seq_len=} must be >= 1")
        if buffer_size < 1:
            raise ValueError(f"{buffer_size=} must be >= 1")
        self.parent, self.row_len, self.buffer_size, self.pad_id = parent, seq_len + 1, buffer_size, pad_id
        self.mode, self.min_fill, self.ramp = mode, min_fill, bool(ramp)
        self.max_wait = buffer_size if max_wait is None else max_wait
        if self.max_wait < 1:
            raise ValueError(f"max_wait={self.max_wait} must be >= 1")
        Slots(1, self.row_len, mode=mode)  # validates mode early
        self.buffer_tokens = self.resolve_buffer_tokens(buffer_tokens, seq_len, mode, buffer_size)
        self._savepoint = SavePoint(parent)
        # A checkpoint's parent state is taken for later (pipes/state_later.py): only the oldest is ever read
        self._take_later = later_of(parent)
        self._clear()

    @classmethod
    def resolve_buffer_tokens(cls, buffer_tokens: Optional[int], seq_len: int, mode: str = "bestfit",
                              buffer_size: int = 1000) -> int:
        """``buffer_tokens``, or the mode's default: ``BESTFIT_ROWS`` rows of ``seq_len + 1`` tokens
        (``bestfit``), half a row per document of ``buffer_size`` (``crop``)."""
        default = cls.BESTFIT_ROWS * (seq_len + 1) if mode == "bestfit" else buffer_size * (seq_len + 1) // 2
        if buffer_tokens is None:
            return max(default, 1)
        if buffer_tokens < 1:
            raise ValueError(f"{buffer_tokens=} must be >= 1 (default for {mode=}: {default} tokens at {seq_len=}, "
                             f"{buffer_size=})")
        return int(buffer_tokens)

    def _clear(self) -> None:
        self._slots = Slots(self.buffer_size, self.row_len, mode=self.mode, min_fill=self.min_fill)
        self._slot_of: Dict[int, int] = {}  # seq -> slot
        self._docs: Dict[int, TokenDoc] = {}  # seq -> the buffered document (where it came from: elastic.py)
        self._ages: Deque[int] = deque()  # buffered seqs in pull order, lazily pruned: the front is the oldest
        # Documents that came in pieces are kept apart from _ages: one a source may stay buffered, parked, for
        # as long as its source takes to send the next piece, and a scan of _ages would step past each of them
        # at every row. A heap of their seqs (the oldest, lazily pruned) and those that may be placeable.
        self._pieced: List[int] = []
        self._unparked: set = set()
        self._tok_at: Dict[int, int] = {}  # seq -> tokens pulled up to and including it (origin: reset or base)
        # (seq, the parent's state before pulling document seq, taken for later (read_later), tokens pulled before it)
        self._ckpts: Deque[Tuple[int, Any, int]] = deque()
        # Per buffered document that came in pieces: the pull of its latest piece, which holds the whole
        # document up to there (pieces.py), so a restore re-reads it from there; and a heap of (pull, seq),
        # lazily pruned, for the earliest of them.
        self._repull: Dict[int, int] = {}
        self._repull_heap: List[Tuple[int, int]] = []
        self._loaded_lists: Optional[Tuple[List[int], List[int], List[List[int]]]] = None
        self._pulled = 0
        self._tokens = 0  # tokens pulled, counted from the same origin as _tok_at
        self._since_ckpt = 0  # tokens pulled since the last checkpoint
        self._held = 0  # tokens of the buffered documents not yet placed or discarded
        self._ended = False
        self._replay_to = 0
        self._replay_live: Dict[int, int] = {}
        self._open: Dict[str, int] = {}  # source -> seq of its document arriving in pieces (pipes/pieces.py)
        self._stats = new_stats()
        # Per slot, its document as a row of the save point's table (source index, 1, epoch, unit,
        # pos, used), filled in by get_state for the documents pulled since the previous one (savepoint.py).
        self._origin = np.ones((self.buffer_size, 6), np.int64)
        self._origin_from = 0  # documents pulled before this one have their origin in the table
        self._moved = False  # next() ran since the reset: the loaded save point no longer describes it
        self._savepoint.clear()

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._clear()
        if initial_state is None:
            self.parent.reset(None)
            return
        base = int(initial_state[self.BASE])
        live = [int(x) for x in initial_state[self.LIVE]]
        consumed = [int(x) for x in initial_state[self.CONSUMED]]
        if len(live) != len(consumed):
            raise StateError(f"BestFitPack: saved state lists {len(live)} buffered documents and {len(consumed)} "
                             "offsets; the state is damaged: pass the value returned by state_dict() unchanged")
        repull = [[int(x) for x in r] for r in initial_state.get(self.REPULL, ())]  # absent: none (or saved before)
        self._replay_to = int(initial_state[self.PULLED])
        # pull -> (seq, tokens delivered, tokens pulled up to it counted from base; None: count them in the replay)
        self._replay_live = {base + o: (base + o, c, None) for o, c in zip(live, consumed)}
        for o, pulled_at, tok in repull:
            got = self._replay_live.pop(base + o, None)
            if got is None or not base <= base + pulled_at < self._replay_to:
                raise StateError(f"BestFitPack: saved state re-reads document {base + o} at pull {base + pulled_at}, "
                                 f"but it lists no such buffered document or that pull is outside [{base}, "
                                 f"{self._replay_to}); the state is damaged: pass the value returned by state_dict() "
                                 "unchanged")
            self._replay_live[base + pulled_at] = (base + o, got[1], tok)
        self.parent.reset(initial_state[self.PARENT])
        self._savepoint.load(initial_state[self.ELASTIC])
        self._pulled = base
        self._origin_from = min([base] + [base + o for o in live])  # documents in pieces may start before base
        self._ckpts.append((base, initial_state[self.PARENT], 0))
        self._loaded_lists = (live, consumed, repull)
        self._ended = bool(initial_state[self.ENDED])
        self._stats = load_stats(initial_state[self.STATS])

    # --- pulling -------------------------------------------------------------------
    def _pull(self) -> Optional[Tuple[int, TokenDoc]]:
        seq = self._pulled
        self._checkpoint(seq)
        try:
            doc = next(self.parent)
        except StopIteration:
            return None
        self._pulled += 1
        n = len(doc.ids) - doc.used
        self._tokens += n
        self._since_ckpt += n
        return seq, doc

    def _checkpoint(self, seq: int) -> None:
        # Counted from the previous checkpoint, so a restored packer (whose first checkpoint is the
        # saved base) takes the same ones as the packer that saved.
        if ((seq % self.CHECKPOINT_EVERY == 0 or self._since_ckpt >= self.CHECKPOINT_ROWS * self.row_len)
                and (not self._ckpts or self._ckpts[-1][0] != seq)):
            self._ckpts.append((seq, self._take_later(), self._tokens))
            self._since_ckpt = 0

    def _add(self, seq: int, doc: TokenDoc, used: int, pulled_at: Optional[int] = None,
             tok_at: Optional[int] = None) -> None:
        """Buffer ``doc`` as document ``seq``. ``pulled_at``, ``tok_at``: a document that came in pieces,
        re-read from its latest piece (pulled at ``pulled_at``), and the tokens pulled up to its first."""
        more = getattr(doc, "more", False)
        self._slot_of[seq] = self._slots.add(seq, doc.ids, used, doc.mask, doc.source, more)
        if more:
            self._open[doc.source] = seq
        if more or pulled_at is not None:
            heappush(self._pieced, seq)
            self._unparked.add(seq)
            self._note_pull(seq, seq if pulled_at is None else pulled_at)
        else:
            self._ages.append(seq)
        self._docs[seq] = doc
        self._tok_at[seq] = self._tokens if tok_at is None else tok_at
        self._held += len(doc.ids) - used

    def _note_pull(self, seq: int, pulled_at: int) -> None:
        self._repull[seq] = pulled_at
        heappush(self._repull_heap, (pulled_at, seq))

    def _append(self, doc: TokenDoc, pulled_at: int) -> int:
        """The next piece of the document its source has in pieces here (pulled as document number
        ``pulled_at``): appended to its slot, so the document is cut into rows as if it had come whole
        (pipes/pieces.py). Returns the tokens added (the caller counts them as held)."""
        seq = self._open[doc.source]
        self._unparked.add(seq)  # a new piece may unpark it
        self._note_pull(seq, pulled_at)
        if doc.used != len(self._docs[seq].ids):
            raise RuntimeError(f"BestFitPack: a piece of source {doc.source!r} starts at token {doc.used}, but the "
                               f"piece before it ended at {len(self._docs[seq].ids)}; pieces must continue each other")
        added = self._slots.extend(self._slot_of[seq], doc.ids, doc.mask, doc.more)
        self._docs[seq] = doc
        if not doc.more:
            del self._open[doc.source]
        return added

    def _close_open(self) -> None:
        """Upstream ended with documents in pieces: what they hold ends them."""
        for seq in self._open.values():
            self._slots.close(self._slot_of[seq])
            self._unparked.add(seq)
        self._open.clear()

    def _replay(self) -> None:
        """Rebuild the buffer after a restore by re-reading the window [base, pulled)."""
        while self._pulled < self._replay_to:
            got = self._pull()
            if got is None:
                raise StateError(
                    f"BestFitPack: upstream ended after {self._pulled} documents while restoring a state that had "
                    f"pulled {self._replay_to}; the data changed since the state was saved"
                )
            seq, doc = got
            if doc.used and doc.source in self._open:  # a piece of a buffered document (open slots never free)
                self._held += self._append(doc, seq)
                continue
            got = self._replay_live.pop(seq, None)
            if got is not None:
                first, used, tok = got
                if tok is None:
                    self._add(first, doc, used)
                else:  # the latest piece of a document that came in pieces: all of it up to here
                    self._add(first, doc, used, pulled_at=seq, tok_at=tok)
        if self._ended and self._open:
            self._close_open()
        self._replay_to = 0

    def fill_limit(self) -> int:
        """Tokens the buffer may hold before the next row: ``buffer_tokens``, reached by a ramp of
        ``RAMP_START`` rows' worth plus one row's worth per ``RAMP_EVERY`` rows emitted. A function
        of the rows emitted (saved with the statistics), so a restored packer fills the same."""
        if not self.ramp:
            return self.buffer_tokens
        ramp = (self.RAMP_START + self._stats["rows"] // self.RAMP_EVERY) * self.row_len
        return min(self.buffer_tokens, ramp)

    def _top_up(self) -> bool:
        """Fill the buffer up to ``buffer_size`` documents and `fill_limit` tokens; returns whether
        upstream has ended."""
        slots, stats, parent, ckpts, every = self._slots, self._stats, self.parent, self._ckpts, self.CHECKPOINT_EVERY
        take_later = self._take_later
        ckpt_tokens = self.CHECKPOINT_ROWS * self.row_len
        limit = self.fill_limit()
        # minus what the row being built already took, and what parked pieces hold (they cannot be placed)
        held = self._held - slots.row_taken - slots.parked_tokens
        tokens = docs = 0
        total, since = self._tokens, self._since_ckpt
        cap, C = self.buffer_size, self.row_len
        # Documents arriving in pieces (at most one a source) count toward neither bound: a parked piece
        # cannot be placed, so counting it would stop the refill with nothing to place (an empty row, and
        # with every source parked, empty rows for ever). With nothing placeable the refill goes on.
        while not self._ended and ((slots.occupied - len(self._open) < cap and held < limit) or held <= 0):
            seq = self._pulled  # the body of _pull and _add, inlined: this loop runs once per document
            if (seq % every == 0 or since >= ckpt_tokens) and (not ckpts or ckpts[-1][0] != seq):
                ckpts.append((seq, take_later(), total))
                since = 0
            try:
                doc = parent.next()
            except StopIteration:
                self._ended = True
                if self._open:
                    self._close_open()
                break
            self._pulled = seq + 1
            n, used = len(doc.ids), doc.used  # used > 0: delivered in part before an elastic resume, or a piece
            tokens += n - used
            total += n - used
            since += n - used
            docs += used == 0
            if used and doc.source in self._open:
                slot = self._slot_of[self._open[doc.source]]
                before = slots.waiting(slot)
                self._append(doc, seq)
                held += slots.waiting(slot) - before
            elif n > used:  # an empty document (no BOS, no text) has nothing to place
                more = getattr(doc, "more", False)
                if more and self.mode != "bestfit":
                    raise ValueError(f"BestFitPack(mode={self.mode!r}) got a piece of a document from source "
                                     f"{doc.source!r} (pipes/pieces.py): crop would discard the pieces after it. "
                                     "Feed it whole documents (no Pieces node), or use mode='bestfit'")
                self._slot_of[seq] = slots.add(seq, doc.ids, used, doc.mask, doc.source, more)
                if more:
                    self._open[doc.source] = seq
                    heappush(self._pieced, seq)
                    self._unparked.add(seq)
                    self._note_pull(seq, seq)
                else:
                    self._ages.append(seq)
                self._docs[seq] = doc
                self._tok_at[seq] = total
                if not more or n - used > C:  # else parked (core.Slots.parked)
                    held += n - used
        self._tokens, self._since_ckpt = total, since
        self._held += tokens
        stats["tokens_in"] += tokens
        stats["documents"] += docs
        return self._ended

    def _oldest(self) -> Optional[int]:
        """The oldest buffered document's seq (None: the buffer is empty); prunes finished ones."""
        ages, live, pieced = self._ages, self._slot_of, self._pieced
        if len(ages) > 2 * len(live) + 64:
            # Finished documents are only dropped off the front; the rest would make every
            # _overdue scan walk past them. Rebuilding when half are dead keeps it amortised O(1).
            self._ages = ages = deque(s for s in ages if s in live)
            self._pieced = pieced = [s for s in pieced if s in live]
            heapify(pieced)
            self._tok_at = {s: self._tok_at[s] for s in chain(ages, pieced)}
        tok_at = self._tok_at
        while ages and ages[0] not in live:
            del tok_at[ages.popleft()]
        while pieced and pieced[0] not in live:
            del tok_at[heappop(pieced)]
        if pieced and (not ages or pieced[0] < ages[0]):
            return pieced[0]
        return ages[0] if ages else None

    def _overdue(self, cap: int = 256) -> List[int]:
        """Slots of documents pulled more than ``max_wait`` pulls or ``buffer_tokens`` tokens ago,
        oldest first."""
        self._oldest()  # prunes finished documents off the front
        limit, seqs = self._pulled - self.max_wait, []
        tok_limit, tok_at, slot_of = self._tokens - self.buffer_tokens, self._tok_at, self._slot_of
        # Both bounds rise with seq (tok_at counts tokens pulled up to each), so the overdue documents
        # are the oldest ones, up to the first that is not. With many sources tens of them wait (each row
        # places a few) among finished ones not yet pruned, so the loop checks the cap only on a find.
        for seq in self._ages:
            if seq >= limit and tok_at[seq] >= tok_limit:  # tok_at covers _ages
                break
            if seq in slot_of:
                seqs.append(seq)
                if len(seqs) >= cap:
                    break
        if self._unparked:
            # Documents in pieces: a parked one (pieces.py) never starts a row, and stays parked until its next
            # piece or the stream's end puts it back in _unparked (a placement only shortens what is left).
            parked = self._slots.parked_rest
            for seq in list(self._unparked):
                slot = slot_of.get(seq)
                if slot is None or slot in parked:
                    self._unparked.discard(seq)
                elif seq < limit or tok_at[seq] < tok_limit:
                    seqs.append(seq)
            seqs.sort()
        return [slot_of[seq] for seq in seqs[:cap]]

    # --- the node ------------------------------------------------------------------
    def next(self) -> Row:
        self._moved = True
        replayed = bool(self._replay_to)
        if replayed:
            self._replay()
        ended = self._top_up()
        if not self._slot_of:
            raise StopIteration
        # The buffer was just topped up: build_row need not ask again (nothing changes in between).
        try:
            out = self._slots.build_row(self._top_up, self._overdue(), ended=ended)
        except ValueError as e:
            if not replayed:
                raise
            # the buffer rebuilt from what upstream gave again does not hold together
            raise StateError(f"BestFitPack: the first row after a restore cannot be built ({e}): "
                             f"{_NOT_THE_SAME}") from e
        for seq in out.freed_seqs:
            del self._slot_of[seq]
            del self._docs[seq]
            self._repull.pop(seq, None)
        filled = int(out.seg_lens.sum())
        self._held -= filled + out.discarded
        out.tokens[filled:] = self.pad_id
        st = self._stats
        st["tokens_out"] += filled
        st["padding"] += self.row_len - filled
        st["discarded"] += out.discarded
        st["chunked"] += out.newly_cut
        st["rows"] += 1
        self._prune_checkpoints()
        return Row(out.tokens, out.seg_lens, out.mask, out.sources, out.starts)

    def _replay_from(self) -> int:
        """The earliest pull a restore must re-read from: the oldest buffered document's, or for one that
        came in pieces its latest piece's (the number of documents pulled when none is buffered)."""
        self._oldest()  # prunes finished documents off the front
        heap, repull, live = self._repull_heap, self._repull, self._slot_of
        while heap and (heap[0][1] not in live or repull.get(heap[0][1]) != heap[0][0]):
            heappop(heap)
        at = self._pulled
        if self._ages:
            at = self._ages[0]
        if heap and heap[0][0] < at:
            at = heap[0][0]
        return at

    def _prune_checkpoints(self) -> None:
        limit = self._replay_from()
        while len(self._ckpts) > 1 and self._ckpts[1][0] <= limit:
            self._ckpts.popleft()
        if len(self._ckpts) > 2 * len(self._slot_of) + 64:
            self._thin_checkpoints()

    def _thin_checkpoints(self) -> None:
        """Keep only the checkpoints a state can still start from: for each buffered document the
        last one at or before the pull it is re-read from (`_replay_from`; the base once the documents
        before it are gone), and the newest.

        Why: the base is the last checkpoint at or before the oldest buffered document, and a document
        in pieces stays buffered until its last piece, which with many sources comes thousands of
        pulls later (a source's turn comes about once per source); every checkpoint in between held
        a state of the mixer (one entry per source), hundreds of MB a worker at 256 sources. Which
        checkpoints are taken, and so every state, is unchanged."""
        ckpts = self._ckpts
        at = np.fromiter((c[0] for c in ckpts), np.int64, len(ckpts))
        repull = self._repull
        live = np.fromiter((repull.get(seq, seq) for seq in self._slot_of), np.int64, len(self._slot_of))
        keep = np.zeros(len(at), bool)
        keep[-1] = True
        keep[np.maximum(np.searchsorted(at, live, side="right") - 1, 0)] = True
        self._ckpts = deque(c for c, k in zip(ckpts, keep.tolist()) if k)

    def get_state(self) -> Dict[str, Any]:
        if self._replay_to:
            # Restored but not yet replayed: the saved position is still the position.
            live, consumed, repull = self._loaded_lists
            return self._state(read_later(self._ckpts[0][1]), self._ckpts[0][0], self._replay_to, live, consumed,
                               self._savepoint.loaded, repull)
        if not self._slot_of:
            return self._state(self.parent.state_dict(), self._pulled, self._pulled, [], [], self._save_point(None))
        self._prune_checkpoints()
        base, parent_state, tok_base = self._ckpts[0]
        parent_state = read_later(parent_state)
        repull = self._repull_rows(base, tok_base)
        # Taken with every batch a worker sends: numpy over the ~buffer_size live documents
        # (0.1 ms at 1000) instead of a Python call per document (1.7 ms).
        n = len(self._slot_of)
        seqs = np.fromiter(self._slot_of.keys(), np.int64, n)
        slots = np.fromiter(self._slot_of.values(), np.int64, n)
        order = np.argsort(seqs, kind="stable")
        slots = slots[order]
        used = self._slots.used_array()[slots]
        return self._state(parent_state, base, self._pulled, (seqs[order] - base).tolist(), used.tolist(),
                           self._save_point((slots, used)), repull)

    def _repull_rows(self, base: int, tok_base: int) -> List[List[int]]:
        """``REPULL``: per buffered document re-read from a later piece, ``[seq, pull, tokens up to seq]``
        from ``base``, by seq. Numpy over the documents in pieces (one a source), not a Python step each."""
        repull = self._repull
        if not repull:
            return []
        seqs = np.fromiter(repull.keys(), np.int64, len(repull))
        at = np.fromiter(repull.values(), np.int64, len(repull))
        later = seqs != at
        if not later.any():
            return []
        seqs, at = seqs[later], at[later]
        order = np.argsort(seqs)
        seqs, at = seqs[order], at[order]
        tok_at = self._tok_at
        tokens = np.fromiter((tok_at[s] for s in seqs.tolist()), np.int64, len(seqs))
        return np.stack([seqs - base, at - base, tokens - tok_base], axis=1).tolist()

    def _save_point(self, buffered: Optional[Tuple[np.ndarray, np.ndarray]]) -> Dict[str, Any]:
        """The save point's summary (savepoint.py): the buffered documents' origins and what they
        still hold, with the positions and counters above the packer."""
        point = self._savepoint
        if not self._moved and point.loaded is not None:
            return point.loaded
        nsrc = point.count()
        if buffered is None:
            return point.take(_NO_ROWS, [0] * (2 * nsrc))
        slots, used = buffered
        grow = self._slots.capacity - len(self._origin)
        if grow > 0:
            self._origin = np.concatenate([self._origin, np.ones((grow, 6), np.int64)])
        origin = self._origin
        if self._origin_from < self._pulled:
            # One Python step per document pulled since the last state (TokenDoc fields by position:
            # source, epoch, unit, pos), one numpy assignment for all of them.
            docs, slot_of, index = self._docs, self._slot_of, point.index.get
            if self._pulled - self._origin_from <= len(slot_of):
                seqs = [seq for seq in range(self._origin_from, self._pulled) if seq in slot_of]
            else:
                seqs = [seq for seq in slot_of if seq >= self._origin_from]
            if seqs:
                new = [slot_of[seq] for seq in seqs]
                got = [docs[seq] for seq in seqs]
                origin[new, 0] = [index(d[1], -1) for d in got]
                origin[new, 2] = [d[3] for d in got]
                origin[new, 3] = [d[4] for d in got]
                origin[new, 4] = [d[5] for d in got]
            self._origin_from = self._pulled
        rows = origin[slots]
        rows[:, 5] = used
        return point.take(rows, again_of(rows[:, 0], self._slots.len[slots], used, nsrc))

    def in_flight(self) -> List[Tuple[TokenDoc, int]]:
        """The buffered documents and how many tokens of each were delivered, oldest first
        (for an elastic resume; a restored buffer is rebuilt first)."""
        if self._replay_to:
            self._replay()
        used = self._slots.used_array()
        return [(self._docs[seq], int(used[self._slot_of[seq]])) for seq in sorted(self._slot_of)]

    def _state(self, parent, base, pulled, live, consumed, elastic, repull=()) -> Dict[str, Any]:
        return {self.PARENT: parent, self.BASE: base, self.PULLED: pulled, self.LIVE: live,
                self.CONSUMED: consumed, self.ENDED: self._ended, self.STATS: dict(self._stats),
                self.ELASTIC: elastic, self.REPULL: list(repull)}

    def carry_stats(self, stats: Dict[str, int]) -> None:
        """Continue the statistics of an elastic resume (elastic.py)."""
        self._stats = load_stats(stats)

    def stats(self) -> Dict[str, int]:
        return dict(self._stats)

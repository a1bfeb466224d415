"""Best-fit packing from a bounded buffer, with a resumable position as its state.

Algorithm, per row of ``C = seq_len + 1`` tokens:

1. keep ``buffer_size`` documents buffered (pulling from upstream as they leave);
2. if the oldest buffered document was pulled more than ``max_wait`` pulls ago,
   it starts the row (this bounds every document's delay, see below);
3. repeatedly place the largest next-segment that fits the space left (ties:
   the oldest document); a document longer than ``C`` contributes segments of at
   most ``C`` tokens, so it is cut into chunks that each fit a row and nothing is
   ever dropped;
4. pad whatever no segment fits.

Lookup uses a sorted index of ``(segment length, age)`` keys, a bisection per
placement. At the end of a finite stream the buffer is drained: every document
comes out.

Delay bound: a document waits at most ``max_wait`` further pulls before it is
forced to the front of a row (one forced document per row), so its wait is at
most about ``max_wait + buffer_size`` documents. The default ``max_wait`` is
``2 * buffer_size``.

State (a position, never the buffer): the upstream state just before the pull of
document number ``base`` (a checkpoint taken every ``CHECKPOINT_EVERY`` pulls,
at or before the oldest buffered document), the number of documents pulled,
the offsets from ``base`` of the documents still buffered and how many tokens of
each were already emitted. A restore re-reads and re-tokenizes the window
``[base, pulled)`` (bounded by the delay bound) and keeps the documents listed.
At ``buffer_size=1000`` the state is about 1000 small ints, a few KB.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from .base import Node, StateError
from .items import Row, TokenDoc
from .pack_stats import load_stats, new_stats

_SEQ_BITS = 40
_SEQ_MASK = (1 << _SEQ_BITS) - 1


def _key(seg_len: int, seq: int) -> int:
    # Sorting by (length, -seq) in one int: among equal lengths the oldest sorts last,
    # so "rightmost key <= (space, max)" is the largest fitting segment, oldest first.
    return (seg_len << _SEQ_BITS) | (_SEQ_MASK - seq)


class BestFitPack(Node[Row]):
    PARENT = "parent"
    BASE = "base"
    PULLED = "pulled"
    LIVE = "live"
    CONSUMED = "consumed"
    ENDED = "ended"
    STATS = "stats"
    STATE_KEYS = (PARENT, BASE, PULLED, LIVE, CONSUMED, ENDED, STATS)

    #: Upstream states are remembered every this many pulls; a restore replays at most this many extra documents.
    CHECKPOINT_EVERY = 32

    def __init__(self, parent: Node[TokenDoc], *, seq_len: int, buffer_size: int = 1000, pad_id: int = 0,
                 max_wait: Optional[int] = None):
        super().__init__()
        if seq_len < 1:
            raise ValueError(f"{seq_len=} must be >= 1")
        if buffer_size < 1:
            raise ValueError(f"{buffer_size=} must be >= 1")
        self.parent, self.row_len, self.buffer_size, self.pad_id = parent, seq_len + 1, buffer_size, pad_id
        self.max_wait = 2 * buffer_size if max_wait is None else max_wait
        if self.max_wait < 1:
            raise ValueError(f"max_wait={self.max_wait} must be >= 1")
        self._clear()

    # --- bookkeeping -------------------------------------------------------------
    def _clear(self) -> None:
        self._docs: Dict[int, List[Any]] = {}  # seq -> [TokenDoc, consumed]
        self._keys: List[int] = []
        self._ages: List[int] = []  # min-heap of seqs, lazily pruned
        self._ckpts: Deque[Tuple[int, Dict[str, Any]]] = deque()
        self._pulled = 0
        self._ended = False
        self._replay_to = 0
        self._replay_live: Dict[int, int] = {}
        self._stats = new_stats()

    def reset(self, initial_state: Optional[Dict[str, Any]] = None) -> None:
        self._clear()
        if initial_state is None:
            self.parent.reset(None)
            return
        base = int(initial_state[self.BASE])
        live = [int(x) for x in initial_state[self.LIVE]]
        consumed = [int(x) for x in initial_state[self.CONSUMED]]
        if len(live) != len(consumed):
            raise StateError(f"BestFitPack: {len(live)=} and {len(consumed)=} differ in the saved state")
        self.parent.reset(initial_state[self.PARENT])
        self._pulled = base
        self._ckpts.append((base, initial_state[self.PARENT]))
        self._replay_to = int(initial_state[self.PULLED])
        self._replay_live = {base + o: c for o, c in zip(live, consumed)}
        self._ended = bool(initial_state[self.ENDED])
        self._stats = load_stats(initial_state[self.STATS])

    def _pull(self) -> Optional[Tuple[int, TokenDoc]]:
        seq = self._pulled
        if seq % self.CHECKPOINT_EVERY == 0 and (not self._ckpts or self._ckpts[-1][0] != seq):
            self._ckpts.append((seq, self.parent.state_dict()))
        try:
            doc = next(self.parent)
        except StopIteration:
            return None
        self._pulled += 1
        return seq, doc

    def _add(self, seq: int, doc: TokenDoc, consumed: int) -> None:
        self._docs[seq] = [doc, consumed]
        bisect.insort(self._keys, _key(min(len(doc.ids) - consumed, self.row_len), seq))
        heapq.heappush(self._ages, seq)

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
            consumed = self._replay_live.pop(seq, None)
            if consumed is not None:
                self._add(seq, doc, consumed)
        self._replay_to = 0

    def _top_up(self) -> None:
        while not self._ended and len(self._docs) < self.buffer_size:
            got = self._pull()
            if got is None:
                self._ended = True
                return
            seq, doc = got
            n = len(doc.ids)
            self._stats["tokens_in"] += n
            self._stats["documents"] += 1
            self._stats["chunked"] += int(n > self.row_len)
            self._add(seq, doc, 0)

    def _oldest(self) -> Optional[int]:
        ages = self._ages
        while ages and ages[0] not in self._docs:
            heapq.heappop(ages)
        return ages[0] if ages else None

    def _take(self, seq: int, space: int, key_index: Optional[int] = None) -> Tuple[TokenDoc, int, int]:
        """Remove ``seq``'s next segment (at most ``space`` tokens) from the buffer."""
        doc, consumed = self._docs[seq]
        n = min(len(doc.ids) - consumed, self.row_len)
        if key_index is None:
            key_index = bisect.bisect_left(self._keys, _key(n, seq))
        del self._keys[key_index]
        take = min(n, space)
        if consumed + take >= len(doc.ids):
            del self._docs[seq]
        else:
            self._docs[seq][1] = consumed + take
            bisect.insort(self._keys, _key(min(len(doc.ids) - consumed - take, self.row_len), seq))
        return doc, consumed, take

    # --- the node ----------------------------------------------------------------
    def next(self) -> Row:
        if self._replay_to:
            self._replay()
        C = self.row_len
        self._top_up()
        if not self._docs:
            raise StopIteration
        tokens = np.full(C, self.pad_id, dtype=np.int32)
        mask: Optional[np.ndarray] = None
        seg_lens: List[int] = []
        sources: List[str] = []
        pos = 0

        def place(doc: TokenDoc, start: int, take: int) -> None:
            nonlocal pos, mask
            tokens[pos:pos + take] = doc.ids[start:start + take]
            if doc.mask is not None:
                if mask is None:
                    mask = np.zeros(C, dtype=bool)
                mask[pos:pos + take] = doc.mask[start:start + take]
            seg_lens.append(take)
            sources.append(doc.source)
            pos += take

        oldest = self._oldest()
        if oldest is not None and self._pulled - oldest > self.max_wait:
            place(*self._take(oldest, C))
        while pos < C:
            self._top_up()
            space = C - pos
            i = bisect.bisect_right(self._keys, (space << _SEQ_BITS) | _SEQ_MASK) - 1
            if i < 0:
                break
            seq = _SEQ_MASK - (self._keys[i] & _SEQ_MASK)
            place(*self._take(seq, space, i))
        self._stats["tokens_out"] += pos
        self._stats["padding"] += C - pos
        self._stats["rows"] += 1
        return Row(tokens, np.asarray(seg_lens, dtype=np.int32), mask, tuple(sources))

    def get_state(self) -> Dict[str, Any]:
        if self._replay_to:
            # Restored but not yet replayed: the saved position is still the position.
            base = self._ckpts[0][0]
            live = sorted(self._replay_live)
            return self._state(self._ckpts[0][1], base, self._replay_to,
                               [s - base for s in live], [self._replay_live[s] for s in live])
        oldest = self._oldest()
        if oldest is None:
            return self._state(self.parent.state_dict(), self._pulled, self._pulled, [], [])
        while len(self._ckpts) > 1 and self._ckpts[1][0] <= oldest:
            self._ckpts.popleft()
        base, parent_state = self._ckpts[0]
        live = sorted(self._docs)
        return self._state(parent_state, base, self._pulled, [s - base for s in live],
                           [self._docs[s][1] for s in live])

    def _state(self, parent, base, pulled, live, consumed) -> Dict[str, Any]:
        return {self.PARENT: parent, self.BASE: base, self.PULLED: pulled, self.LIVE: live,
                self.CONSUMED: consumed, self.ENDED: self._ended, self.STATS: dict(self._stats)}

    def stats(self) -> Dict[str, int]:
        return dict(self._stats)

"""The placement core in pure Python: the same algorithm and arrays as ``_packcore.c``.

Used when the C extension was not built (no compiler at install time), and by
the tests as the reference the C core must agree with, row for row. It is
much slower than the C core (benchmarks/packing.py times both); `core.IMPLEMENTATION`
says which one runs.
"""

from __future__ import annotations

from typing import List, Optional

import numpy as np

MODE_BESTFIT, MODE_CROP = 0, 1


def _next_len(ln, used, s, C):
    r = int(ln[s]) - int(used[s])
    return r if r < C else C


def _set_bit(bits, L, on):
    w, b = L >> 6, np.uint64(1 << (L & 63))
    bits[w] = bits[w] | b if on else bits[w] & ~b


def _remove(head, tail, nxt, prv, bits, s, L):
    p, n = int(prv[s]), int(nxt[s])
    if p >= 0:
        nxt[p] = n
    else:
        head[L] = n
    if n >= 0:
        prv[n] = p
    else:
        tail[L] = p
    if head[L] < 0:
        _set_bit(bits, L, False)


def insert(seq, ln, used, head, tail, nxt, prv, bits, s, C):
    L = _next_len(ln, used, s, C)
    if L < 1:
        raise ValueError(f"_packcore.insert: slot {s} is out of range or empty")
    q = int(seq[s])
    p = int(tail[L])
    while p >= 0 and int(seq[p]) > q:
        p = int(prv[p])
    n = int(nxt[p]) if p >= 0 else int(head[L])
    prv[s], nxt[s] = p, n
    if p >= 0:
        nxt[p] = s
    else:
        head[L] = s
    if n >= 0:
        prv[n] = s
    else:
        tail[L] = s
    _set_bit(bits, L, True)


def insert_many(seq, ln, used, head, tail, nxt, prv, bits, C, slots, seqs, lens, used0):
    for s, q, n, u in zip(slots, seqs, lens, used0):
        seq[s], ln[s], used[s] = q, n, u
        insert(seq, ln, used, head, tail, nxt, prv, bits, s, C)


def _nonempty(bits) -> int:
    return sum(int(w) << (64 * i) for i, w in enumerate(bits))


def parked(ln, used, opened, s, C) -> bool:
    """An open slot (its document's next pieces still to come) with a row or less left: out of the
    index, never placed whole mid-row (see _packcore.c)."""
    return bool(opened[s]) and int(ln[s]) - int(used[s]) <= C


def _le(mask: int, x: int) -> int:
    """The largest non-empty length <= ``x`` in the bitmap ``mask``, or -1 (``ix_le`` in _packcore.c)."""
    return (mask & ((1 << (x + 1)) - 1)).bit_length() - 1


def _gt(mask: int, x: int) -> int:
    """The smallest non-empty length > ``x`` in the bitmap ``mask``, or -1 (``ix_gt`` in _packcore.c)."""
    above = mask >> (x + 1)
    return x + 1 + ((above & -above).bit_length() - 1) if above else -1


def _oldest_with(ln, used, head, nxt, C, at_least) -> int:
    """The oldest slot of length C (a row or more left) with at least ``at_least`` tokens left, or -1."""
    c = int(head[C])
    while c >= 0:
        if int(ln[c]) - int(used[c]) >= at_least:
            return c
        c = int(nxt[c])
    return -1


def _row_opener(ln, used, head, nxt, C, mode, nforced):
    """``(slot, C)`` for a row that starts with a full row of one document, else ``(-1, 0)``: crop
    starts a row with a document of a row or more; bestfit, when nothing is overdue, drains a document
    with two rows' worth or more left (see _packcore.c)."""
    if mode == MODE_CROP and int(head[C]) >= 0:
        return int(head[C]), C
    if mode == MODE_BESTFIT and nforced == 0:
        c = _oldest_with(ln, used, head, nxt, C, 2 * C)
        if c >= 0:
            return c, C
    return -1, 0


def _fits_overdue(seq, ln, used, opened, c, C, pos) -> bool:
    """Whether overdue slot ``c`` is still buffered, not parked, and its next segment fits the row from ``pos``."""
    return int(seq[c]) >= 0 and not parked(ln, used, opened, c, C) and _next_len(ln, used, c, C) <= C - pos


def _fill_space(ln, used, head, nxt, bits, C, mode, min_fill, space, may_stop, ended):
    """``(slot, take, stuck)`` for ``space`` left in the row and no overdue slot to place: the largest
    next segment that fits; else stuck when ``may_stop`` (the caller tops the buffer up and calls
    again); else bestfit cuts the gap off the oldest document longer than a row (not under
    ``min_fill``) and crop takes the smallest one that does not fit, or pads once upstream has ``ended``.
    Slot -1: the row ends here."""
    mask = _nonempty(bits)
    L = _le(mask, space)
    if L >= 0:
        return int(head[L]), L, 0
    if may_stop:
        return -1, 0, 1
    if mode == MODE_BESTFIT:
        return (_oldest_with(ln, used, head, nxt, C, C + 1) if space >= min_fill else -1), space, 0
    if ended:
        return -1, 0, 0  # crop once upstream ended: pad, the buffered documents all get rows of their own
    L2 = _gt(mask, space)
    return (int(head[L2]), space, 0) if L2 >= 0 else (-1, 0, 0)


def _copy_segment(docs, masks, s, start, take, row, rowmask, pos) -> None:
    """Copy ``take`` tokens (and mask values) of slot ``s`` from ``start`` into the row at ``pos``."""
    row[pos:pos + take] = docs[s][start:start + take]
    if rowmask is not None:
        m = None if masks is None else masks[s]
        rowmask[pos:pos + take] = 1 if m is None else m[start:start + take]


def _rest_after(ln, used, s, start, mode):
    """``(rest, discarded, cut)`` once a segment of slot ``s`` from ``start`` was placed: the tokens it
    has left (none in crop, which discards them), and whether this cut its document."""
    rest = int(ln[s]) - int(used[s])
    if rest > 0 and mode == MODE_CROP:
        used[s] = ln[s]
        return 0, rest, 1
    return rest, 0, int(rest > 0 and start == 0)


def build_row(docs: List[np.ndarray], masks: Optional[list], seq, ln, used, head, tail, nxt, prv, bits, row, rowmask,
              seglen, segslot, segoff, freed, forced, opened, C, mode, nforced, min_fill, pos, nseg, nfreed, ended):
    """Continue one row from (pos, nseg, nfreed), as ``py_build_row`` in _packcore.c does; returns
    (segments, filled, freed, discarded, newly_cut, stuck)."""
    discarded = newly_cut = 0
    stuck, nfreed0 = 0, nfreed
    f = 0
    s, take = _row_opener(ln, used, head, nxt, C, mode, nforced) if pos == 0 and nseg == 0 else (-1, 0)
    while True:
        if s < 0 and C - pos == 1:
            break  # the label slot stays padding, in crop too (see _packcore.c)
        if s < 0 and f < nforced:
            c = int(forced[f])
            if _fits_overdue(seq, ln, used, opened, c, C, pos):
                s, take = c, _next_len(ln, used, c, C)
                f += 1
            else:
                f = nforced
                continue
        if s < 0:
            space = C - pos
            if space == 0:
                break
            s, take, stuck = _fill_space(ln, used, head, nxt, bits, C, mode, min_fill, space,
                                         not ended and nfreed > nfreed0, ended)
            if s < 0:
                break
        start = int(used[s])
        _copy_segment(docs, masks, s, start, take, row, rowmask, pos)
        _remove(head, tail, nxt, prv, bits, s, _next_len(ln, used, s, C))
        seglen[nseg], segslot[nseg], segoff[nseg] = take, s, start
        nseg += 1
        pos += take
        used[s] = start + take
        rest, lost, cut = _rest_after(ln, used, s, start, mode)
        discarded += lost
        newly_cut += cut
        if rest == 0:
            seq[s] = -1
            freed[nfreed] = s
            nfreed += 1
        elif not parked(ln, used, opened, s, C):
            insert(seq, ln, used, head, tail, nxt, prv, bits, s, C)
        s = -1
    if pos < C and not stuck:
        row[pos:] = 0
        if rowmask is not None:
            rowmask[pos:] = 0
    return nseg, pos, nfreed, discarded, newly_cut, stuck

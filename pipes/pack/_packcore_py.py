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


def build_row(docs: List[np.ndarray], masks: Optional[list], seq, ln, used, head, tail, nxt, prv, bits, row, rowmask,
              seglen, segslot, segoff, freed, forced, opened, C, mode, nforced, min_fill, pos, nseg, nfreed, ended):
    discarded = newly_cut = 0
    stuck, nfreed0 = 0, nfreed
    s, f, take = -1, 0, 0
    if pos == 0 and nseg == 0 and mode == MODE_CROP and int(head[C]) >= 0:
        s, take = int(head[C]), C  # crop: a document of a row or more starts a row of its own
    if pos == 0 and nseg == 0 and mode == MODE_BESTFIT and nforced == 0:
        c = int(head[C])
        while c >= 0:
            if int(ln[c]) - int(used[c]) >= 2 * C:
                s, take = c, C
                break
            c = int(nxt[c])
    while True:
        if s < 0 and mode == MODE_BESTFIT and C - pos == 1:
            break  # the label slot stays padding (see _packcore.c)
        if s < 0 and f < nforced:
            c = int(forced[f])
            if int(seq[c]) >= 0 and not parked(ln, used, opened, c, C) and _next_len(ln, used, c, C) <= C - pos:
                s, take = c, _next_len(ln, used, c, C)
                f += 1
            else:
                f = nforced
                continue
        if s < 0:
            space = C - pos
            if space == 0:
                break
            mask = _nonempty(bits)
            below = mask & ((1 << (space + 1)) - 1)
            if below:
                L = below.bit_length() - 1
                s, take = int(head[L]), L
            elif not ended and nfreed > nfreed0:
                stuck = 1
                break
            elif mode == MODE_BESTFIT:
                if space < min_fill:
                    break
                c = int(head[C])
                while c >= 0:
                    if int(ln[c]) - int(used[c]) > C:
                        s = c
                        break
                    c = int(nxt[c])
                if s < 0:
                    break
                take = space
            else:
                above = mask >> (space + 1)
                if not above:
                    break
                L2 = space + 1 + ((above & -above).bit_length() - 1)
                s, take = int(head[L2]), space
        start = int(used[s])
        row[pos:pos + take] = docs[s][start:start + take]
        if rowmask is not None:
            m = None if masks is None else masks[s]
            rowmask[pos:pos + take] = 1 if m is None else m[start:start + take]
        _remove(head, tail, nxt, prv, bits, s, _next_len(ln, used, s, C))
        seglen[nseg], segslot[nseg], segoff[nseg] = take, s, start
        nseg += 1
        pos += take
        used[s] = start + take
        rest = int(ln[s]) - int(used[s])
        if rest > 0 and mode == MODE_CROP:
            discarded += rest
            used[s] = ln[s]
            newly_cut += 1
            rest = 0
        elif rest > 0 and start == 0:
            newly_cut += 1
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

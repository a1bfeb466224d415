"""The order of the rows inside one work unit, read in windows.

A reader reads a unit's rows in a seeded order per (epoch, unit), and a shard reads positions
``[lo, hi)`` of that order (shard.py). Decoding a whole unit (a parquet row group, which can be
hundreds of MB) to serve one position would make a worker's memory grow with the unit and with
the number of sources; so a unit larger than its *window* is read in windows of rows, in file
order, and the order only shuffles rows within a window:

- window ``k`` of a unit of ``n`` rows with ``w`` rows per window is rows ``[k*w, min(n, (k+1)*w))``
  in file order, and positions ``[k*w, min(n, (k+1)*w))`` of the order: position ``p`` lies in
  window ``p // w``, so a slice ``[lo, hi)`` needs windows ``lo // w .. (hi - 1) // w`` only, read
  one after the other;
- inside window ``k`` the rows come in ``rng_for(seed, ROW_ORDER_TAG, epoch, unit, k)``'s
  permutation;
- a unit that fits in one window (``n <= w``) keeps the order of whole-unit reading,
  ``rng_for(seed, ROW_ORDER_TAG, epoch, unit).permutation(n)``, exactly: corpora whose row groups
  are smaller than the window read as before.

Every position maps to one row and back, so each row is read once per epoch and shards that
split a unit stay disjoint, whatever the window. The window is a deterministic function of the
listing (`window_rows`: the footer's uncompressed size of the column per row group, so no data
is read to decide it) and of the byte budget; a resume must use the same budget (the recipes
record it, recipes/settings.py ``read_budget``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from ..shard import ROW_ORDER_TAG, rng_for

#: A window holds at least this many rows, however small the budget per source (the budget is
#: then exceeded rather than the shuffle within a unit shrinking to nothing).
MIN_WINDOW_ROWS = 8


def window_rows(rows: np.ndarray, col_bytes: np.ndarray, window_bytes: int,
                min_rows: int = MIN_WINDOW_ROWS) -> np.ndarray:
    """Rows per window of each unit: ``window_bytes`` over the unit's bytes per row (its column's
    uncompressed size over its rows, rounded up), at least ``min_rows``; integer arithmetic only,
    so every process and machine gets the same windows. A unit with ``rows <= window`` is one window.

    Args:
        rows: rows of each unit.
        col_bytes: uncompressed bytes of the read column in each unit (parquet footer).
        window_bytes: decoded bytes one window of one source may hold.
        min_rows: the least rows of a window."""
    if window_bytes < 1:
        raise ValueError(f"{window_bytes=} must be >= 1")
    rows = np.asarray(rows, np.int64)
    per_row = np.maximum(-(-np.asarray(col_bytes, np.int64) // np.maximum(rows, 1)), 1)
    return np.maximum(np.int64(window_bytes) // per_row, np.int64(min_rows))


def windowed(n: int, window: Optional[int]) -> bool:
    """Is a unit of ``n`` rows read in several windows of ``window`` rows (None or 0: whole units)?"""
    return bool(window) and n > window


def ordered_rows(seed: int, epoch: int, unit: int, n: int, lo: int, hi: int, *,
                 window: Optional[int] = None, shuffle: bool = True) -> np.ndarray:
    """Rows (indices in file order) at positions ``[lo, hi)`` of unit ``unit``'s order in ``epoch``
    (see the module docstring): computes only the windows the range covers."""
    if not shuffle:
        return np.arange(lo, hi, dtype=np.int64)
    if not windowed(n, window):
        return rng_for(seed, ROW_ORDER_TAG, epoch, unit).permutation(n)[lo:hi]
    w = int(window)
    out = np.empty(max(hi - lo, 0), np.int64)
    for k in range(lo // w, (hi - 1) // w + 1 if hi > lo else lo // w):
        start, stop = k * w, min(n, (k + 1) * w)
        perm = start + rng_for(seed, ROW_ORDER_TAG, epoch, unit, k).permutation(stop - start)
        a, b = max(lo, start), min(hi, stop)
        out[a - lo:b - lo] = perm[a - start:b - start]
    return out

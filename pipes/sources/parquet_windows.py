"""One row group's column read in windows of rows, sequentially, with pyarrow's ``iter_batches``.

Window ``k`` is rows ``[k*w, min(n, (k+1)*w))`` of the row group in file order (row_windows.py
says why and how positions map to windows). Reading a window decodes the pages up to its end
and keeps only the window: what a reader holds between two reads is one window, whatever the
row group's size.

Two ways to reach window ``k``, chosen by the number of windows of the row group (the order
and the texts are the same either way; only memory and CPU differ):

- few windows (at most `REOPEN_WINDOWS`): each read makes a new `pq.ParquetFile` (from the
  kept handle and footer: no read) and ``iter_batches``, drops the windows before ``k`` (decoded,
  not kept), and lets both go after it, so nothing but the window stays held (a `pq.ParquetFile`
  keeps memory of the row group it read while it lives, parquet.py's `OpenParquet`). Costs up to
  ``REOPEN_WINDOWS / 2`` extra window decodes per window, cheap beside tokenizing them (decoding
  is tens of times faster than encoding);
- many windows: the stream stays open between reads, so consecutive windows cost one decode
  each; it holds pyarrow's decoder state until the row group is done: the column chunk's
  compressed bytes (pyarrow reads a chunk whole unless given ``buffer_size``), its dictionary
  page and about one data page. Per source, so with many sources and huge row groups this is
  what grows; `REOPEN_WINDOWS` trades it for CPU. (Every stream kept open, even with a read
  ``buffer_size``, held about a decoded row group per source: figures in docs/performance.md,
  "Many sources".)

A read that goes back (a restore, a new slice of the same unit that starts earlier) opens a new
stream and skips forward.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, List, Optional

import pyarrow as pa
import pyarrow.parquet as pq

#: Row groups of at most this many windows are read by reopening (nothing held between reads).
REOPEN_WINDOWS = 16


class RowsChanged(RuntimeError):
    """A row group has other rows than listing counted: its file changed after the loader was built."""


def windows_of(parquet: pq.ParquetFile, row_group: int, column: str, window: int) -> Iterator[pa.ChunkedArray]:
    """Windows of exactly ``window`` rows (the last one shorter) of ``column`` in ``row_group``,
    in file order, whatever batch sizes pyarrow yields."""
    pending: List[pa.Array] = []
    have = 0
    for batch in parquet.iter_batches(batch_size=window, row_groups=[row_group], columns=[column],
                                      use_threads=False):
        pending.append(batch.column(0))
        have += batch.num_rows
        while have >= window:
            merged = pa.chunked_array(pending)
            yield merged.slice(0, window)
            rest = merged.slice(window)
            pending, have = list(rest.chunks), len(rest)
    if have:
        yield pa.chunked_array(pending)


class UnitWindows:
    """The windows of one unit (a row group's column), read on demand (module docstring).

    Args:
        make: makes the file as a new `pq.ParquetFile` (over bytes fetched ahead, or the file itself).
        unit, row_group, column: which unit, row group and column.
        rows: the row group's rows (listing's count).
        window: rows per window.
    """

    def __init__(self, make: Callable[[], pq.ParquetFile], *, unit: int, row_group: int, column: str, rows: int,
                 window: int):
        self.make, self.unit, self.row_group, self.column = make, unit, row_group, column
        self.rows, self.window = int(rows), int(window)
        self.count = -(-self.rows // self.window)
        self.keep_open = self.count > REOPEN_WINDOWS
        self._stream: Optional[Iterator[pa.ChunkedArray]] = None
        self._next = 0  # the window the open stream yields next

    def get(self, k: int) -> pa.ChunkedArray:
        """Window ``k`` (``0 <= k < count``); raises what pyarrow raises reading it."""
        if not 0 <= k < self.count:
            raise IndexError(f"window {k} of a unit of {self.count} windows")
        if self._stream is None or k < self._next:
            self.close()
            self._stream, self._next = windows_of(self.make(), self.row_group, self.column, self.window), 0
        try:
            while self._next < k:  # decoded and dropped: bounded memory, CPU instead
                next(self._stream)
                self._next += 1
            out = next(self._stream)
        except StopIteration:
            raise RowsChanged(f"the row group ended before window {k} of {self.count} ({self.rows} rows listed): "
                               "the file changed after the loader was built") from None
        self._next = k + 1
        want = min(self.window, self.rows - k * self.window)
        if len(out) != want:
            raise RowsChanged(f"window {k} has {len(out)} rows, listing's {self.rows} rows make {want}: "
                               "the file changed after the loader was built")
        if not self.keep_open:
            self.close()
        return out

    def close(self) -> None:
        """Drop the open stream (and what pyarrow holds for it)."""
        stream: Any = self._stream
        self._stream = None
        if stream is not None:
            stream.close()

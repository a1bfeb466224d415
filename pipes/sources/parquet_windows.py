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

A read that needs several windows of the row group (``last`` > ``k``: the reader's slice goes on
past window ``k``) and may reopen decodes them in one pass instead, from window ``k`` on, each held
with its rows lz4-compressed (held_rows.py), until the compressed rows reach ``hold_bytes`` (the
recipes: `HOLD_WINDOWS` times the source's share of the read budget) or window ``last``: a row
group of one dictionary page costs a decode per few windows rather than one per window, and what
waits is a fraction of the same rows decoded. A window held is let go when the reader asks for a
later one.

A read that goes back (a restore, a new slice of the same unit that starts earlier) opens a new
stream and skips forward.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, List, Optional, Union

import pyarrow as pa
import pyarrow.parquet as pq

from .held_rows import HeldWindow, holdable

#: Row groups of at most this many windows are read by reopening (nothing decoded held between reads).
REOPEN_WINDOWS = 16
#: Rows held compressed ahead of a reader take at most this many times its share of the read budget
#: (`UnitWindows` ``hold_bytes``; without a share, this many times the text of the window just read).
#: A reader used to hold one window decoded, about its share; compressed, two shares hold several.
HOLD_WINDOWS = 2


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
        hold_bytes: compressed bytes of rows held ahead of the reader, at most (about: the last window
            held may pass it); None: `HOLD_WINDOWS` times the text of the window just read.
    """

    def __init__(self, make: Callable[[], pq.ParquetFile], *, unit: int, row_group: int, column: str, rows: int,
                 window: int, hold_bytes: Optional[int] = None):
        self.make, self.unit, self.row_group, self.column = make, unit, row_group, column
        self.rows, self.window, self.hold_bytes = int(rows), int(window), hold_bytes
        self.count = -(-self.rows // self.window)
        self.keep_open = self.count > REOPEN_WINDOWS
        self._stream: Optional[Iterator[pa.ChunkedArray]] = None
        self._next = 0  # the window the open stream yields next
        self._held: Dict[int, HeldWindow] = {}  # windows decoded ahead of the reader, compressed

    def get(self, k: int, last: Optional[int] = None) -> Union[pa.ChunkedArray, HeldWindow]:
        """Window ``k`` (``0 <= k < count``); raises what pyarrow raises reading it. ``last``: the last
        window the reader will want, in order (its slice's). When past ``k``, window ``k`` and those after
        it, up to ``last`` and as many as ``hold_bytes`` holds, are decoded now and held compressed: a
        `HeldWindow` is returned, for ``k`` and for each of those when asked for."""
        if not 0 <= k < self.count:
            raise IndexError(f"window {k} of a unit of {self.count} windows")
        held = self._held.pop(k, None)
        if held is not None:
            for j in [j for j in self._held if j < k]:  # passed: let go
                del self._held[j]
            return held
        self._held.clear()
        if self._stream is None or k < self._next:
            self.close()
            self._stream, self._next = windows_of(self.make(), self.row_group, self.column, self.window), 0
        while self._next < k:  # decoded and dropped: bounded memory, CPU instead
            self._read(self._next)
        out = self._read(k)
        last = k if last is None else min(last, self.count - 1)
        if last > k and not self.keep_open and holdable(out):
            first = HeldWindow(out)
            del out
            # The windows after the last one held are decoded by a later read.
            bound = HOLD_WINDOWS * int(first.sizes.sum()) if self.hold_bytes is None else self.hold_bytes
            room = bound - first.nbytes
            for j in range(k + 1, last + 1):
                if room <= 0:
                    break
                held = self._held[j] = HeldWindow(self._read(j))
                room -= held.nbytes
            self.close()
            return first
        if not self.keep_open:
            self.close()
        return out

    def _read(self, k: int) -> pa.ChunkedArray:
        """The open stream's next window, which is ``k``, checked against listing's row count."""
        try:
            out = next(self._stream)  # type: ignore[arg-type]
        except StopIteration:
            raise RowsChanged(f"the row group ended before window {k} of {self.count} ({self.rows} rows listed): "
                               "the file changed after the loader was built") from None
        self._next = k + 1
        want = min(self.window, self.rows - k * self.window)
        if len(out) != want:
            raise RowsChanged(f"window {k} has {len(out)} rows, listing's {self.rows} rows make {want}: "
                               "the file changed after the loader was built")
        return out

    def held_bytes(self) -> int:
        """Compressed bytes of the windows held ahead of the reader."""
        return sum(h.nbytes for h in self._held.values())

    def close(self) -> None:
        """Drop the open stream (and what pyarrow holds for it); windows held stay (`drop` lets them go)."""
        stream: Any = self._stream
        self._stream = None
        if stream is not None:
            stream.close()

    def drop(self) -> None:
        """Let go of everything: the open stream and the windows held."""
        self._held.clear()
        self.close()

"""A window of text rows held lz4-compressed, one buffer per row: a row group read in windows is
decoded once per few windows, not once per window.

Why: parquet writers store a text column's values in a dictionary page by default (pyarrow up to a
mebibyte of it), and a row group of unique documents is then mostly that one page. Reading any window
of its rows decompresses and decodes the whole page, so a reader whose share of ``read_budget`` is
a seventh of its row groups decoded each group seven times: with many sources, the largest cost
of reading. Holding the windows decoded would hold the row group; compressed, they take a fraction
of that, and lz4 decompresses faster than the files' codecs do (figures: docs/performance.md, "Many
sources", its fifth pass). So when a slice needs several windows of a row group,
`UnitWindows.get` (parquet_windows.py) decodes them in one pass, each row compressed as it comes, up to a byte bound (twice the source's share of the budget, as the recipes set it:
about what one decoded window used to take, on average); a chunk of texts decompresses just its
rows, and a window is let go once the reader has passed it.

Rows come out exactly as Arrow gives them (``to_pylist``: str, or None for a null; invalid UTF-8
raises `BadRow` naming the row): what changes is only when the bytes are decoded and where they
wait. Only plain ``string`` and ``large_string`` columns are held; others (views, dictionaries,
lists) are read window by window as before (`holdable`).
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import pyarrow as pa

#: The codec of held rows (pyarrow's ``lz4_raw``: no frame header per row; the sizes are kept).
CODEC = "lz4_raw"
_codec: List[Optional[pa.Codec]] = []


def codec() -> Optional[pa.Codec]:
    """The codec held rows use, or None where this pyarrow was built without it."""
    if not _codec:
        _codec.append(pa.Codec(CODEC) if pa.Codec.is_available(CODEC) else None)
    return _codec[0]


def rows_within(lengths: np.ndarray, limit: int) -> int:
    """How many first rows of these byte lengths hold at most ``limit`` bytes (at least one): a reader's
    chunk of texts, whether its rows are held here or in an Arrow column (parquet.py)."""
    return max(1, int(np.searchsorted(np.cumsum(lengths), limit, side="right")))


def holdable(window: pa.ChunkedArray) -> bool:
    """Can this window's rows be held compressed (a plain string column, and the codec built)?"""
    t = window.type
    return (pa.types.is_string(t) or pa.types.is_large_string(t)) and codec() is not None


class BadRow(ValueError):
    """Row ``index`` (of the window) is not valid UTF-8; ``error`` is the decoder's."""

    def __init__(self, index: int, error: UnicodeDecodeError):
        super().__init__(f"row {index} of the window: {error}")
        self.index, self.error = index, error


class HeldWindow:
    """One window's rows, each compressed apart (None for a null row, "" for an empty text), with their
    sizes in bytes.

    Args:
        window: the window's column, a string or large_string ChunkedArray (`holdable`).
    """

    __slots__ = ("blobs", "sizes", "nbytes")

    def __init__(self, window: pa.ChunkedArray):
        c = codec()
        blobs: List[Any] = []
        sizes: List[int] = []
        for chunk in window.chunks:
            n = len(chunk)
            if not n:
                continue
            validity, offsets, data = chunk.buffers()
            dtype = np.int64 if pa.types.is_large_string(chunk.type) else np.int32
            ends = np.frombuffer(offsets, dtype)[chunk.offset:chunk.offset + n + 1].tolist()
            valid = None
            if chunk.null_count:
                bits = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
                valid = bits[chunk.offset:chunk.offset + n].tolist()
            for j in range(n):
                if valid is not None and not valid[j]:
                    blobs.append(None)
                    sizes.append(0)
                    continue
                a, b = ends[j], ends[j + 1]
                blobs.append(c.compress(data.slice(a, b - a), asbytes=True) if b > a else "")
                sizes.append(b - a)
        self.blobs, self.sizes = blobs, np.asarray(sizes, np.int64)
        self.nbytes = sum(len(b) for b in blobs if b is not None)

    def __len__(self) -> int:
        return len(self.blobs)

    def texts(self, idx: np.ndarray, limit: int) -> List[Optional[str]]:
        """The texts of rows ``idx`` (of this window), in that order: as many first ones as hold at most
        ``limit`` bytes of text, at least one (the reader's chunk). Raises `BadRow` for invalid UTF-8."""
        if len(idx) > 1:
            idx = idx[:rows_within(self.sizes[idx], limit)]
        c, blobs, sizes = codec(), self.blobs, self.sizes
        out: List[Optional[str]] = []
        for r in idx.tolist():
            blob = blobs[r]
            if blob is None or blob.__class__ is str:  # a null, or an empty text
                out.append(blob)
                continue
            raw = c.decompress(blob, decompressed_size=int(sizes[r]), asbytes=True)
            try:
                out.append(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                raise BadRow(r, e) from None
        return out
